"""Peak memory, the one measure `speculor bench` records, `speculor generate` prints and `speculor serve` exposes.

On a GPU it is the peak of tensors held by torch's CUDA allocator; on a CPU it is the process's peak resident set
(Linux's VmHWM: the models' weights, their packed copies, the KV caches and the interpreter itself).
`reset_peak_memory` starts a new high-water mark (bench: one per measured record); without a reset the peak is
the process's since it started, loading the models included.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a GPU's allocator is asked: the loadtest client reads a server's peak too
    import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark: CUDA's allocator statistics, or on Linux the process's peak resident set
    (writing 5 to /proc/self/clear_refs resets VmHWM to the current resident set)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_gib(device: torch.device) -> float | None:
    """GiB at the high-water mark since `reset_peak_memory` (or since the process started): tensors allocated on a
    GPU, or the process's resident set on a CPU (the models included); None where the OS does not say."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    return _status_gib("VmHWM")


def resident_gib() -> float | None:
    """The process's resident set now (VmRSS), in GiB; None where the OS does not say."""
    return _status_gib("VmRSS")


def peak_rss_gib(pid: int) -> float | None:
    """Another process's peak resident set (VmHWM), in GiB; None where the OS does not say."""
    return _status_gib("VmHWM", str(pid))


def _status_gib(key: str, pid: str = "self") -> float | None:
    """A kB field of /proc/<pid>/status in GiB (None off Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith(f"{key}:")), None)
    return int(line.split()[1]) / 2**20 if line else None


def drop_file_pages(tensor: torch.Tensor) -> int:
    """Take a tensor's pages out of the resident set when it is a view of a mapped safetensors file (transformers
    maps the file and its weights are views of it); returns the bytes dropped (0 for any other memory).

    madvise(MADV_DONTNEED) unmaps the pages; a later read faults them in again from the file. The mapping is private
    (copy on write), so a value written in place since loading would read back as the file's: call it only for a
    tensor nothing has written (pack_linears: the fp32 weight it has just replaced, or the embedding table tied to
    it, which lookups only read). Otherwise every page read while packing stays mapped (and counted) until the
    whole file is unmapped.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous() or not _MAPS.exists():
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()  # the first element's address
    stop = start + tensor.numel() * tensor.element_size()
    if not _in_safetensors_mapping(start, stop):
        return 0
    lo, hi = -(-start // page) * page, stop // page * page  # whole pages inside the tensor only
    if hi <= lo or _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


_MAPS = Path("/proc/self/maps")
_MADV_DONTNEED = 4  # Linux


def _in_safetensors_mapping(start: int, stop: int) -> bool:
    """True when [start, stop) lies inside one mapping of a .safetensors file."""
    for line in _MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= start < hi:
            return stop <= hi and len(fields) == 6 and fields[5].strip().endswith(".safetensors")
    return False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
