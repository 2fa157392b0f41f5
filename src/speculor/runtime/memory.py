"""Peak memory, the one measure `speculor bench` records, `speculor generate` prints and `speculor serve` exposes.

On a GPU it is the peak of tensors held by torch's CUDA allocator; on a CPU it is the process's peak resident set
(Linux's VmHWM: the models' weights, their packed copies, the KV caches and the interpreter itself).
`reset_peak_memory` starts a new high-water mark (bench: one per measured record); without a reset the peak is
the process's since it started, loading the models included.
"""

from __future__ import annotations

from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark: CUDA's allocator statistics, or on Linux the process's peak resident set
    (writing 5 to /proc/self/clear_refs resets VmHWM to the current resident set)."""
    if device.type == "cuda":
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
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _status_gib("VmHWM")


def resident_gib() -> float | None:
    """The process's resident set now (VmRSS), in GiB; None where the OS does not say."""
    return _status_gib("VmRSS")


def _status_gib(key: str) -> float | None:
    """A kB field of /proc/self/status in GiB (None off Linux)."""
    try:
        status = _STATUS.read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith(f"{key}:")), None)
    return int(line.split()[1]) / 2**20 if line else None
