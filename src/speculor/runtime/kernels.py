"""Faster CPU matmuls: the best fp32 kernel per block size for the target, int8 weights for the draft.

A Linear's cost on the project CPU depends on the kernel far more than on the number of rows. Measured per
matrix (ms; 8 distinct 1536->8960 weights in turn, so no cache help; 1 / 2 / 5 / 8 / 16 / 100 rows):
nn.Linear (MKL) 4.5 / 9.2 / 20.7 / 26.3 / 27.5; MKL as W·xᵀ (its tall-skinny GEMM) 3.8 / 3.7 / 4.5 / 6.0 /
13; oneDNN with W reordered once for batch size 1 (= `to_mkldnn`) 2.4 / 5.3 / 6.9 / 8.0 / 10.3 / 39;
oneDNN with W reordered for batch size 16: 2.8 / 3.1 / 3.8 / 5.0 / 8.0 / 38 (for 2, 4 or 8 alike). One
row at 2.4 ms reads the 55 MB at the machine's ~20 GB/s. `PackedLinear` therefore keeps both oneDNN
copies: one row (a plain decoding step) through the first, any other block (a chain or tree to verify,
a prefill) through the second. `pack_linears(model)` swaps every nn.Linear of a CPU fp32 model for one;
both are fp32 arithmetic of the same weights, equal up to summation order. The model's parameters are
untouched (the two copies are extra memory, twice the weights; the safetensors-mapped originals stay
file-backed pages the OS may drop).

The draft only proposes: any draft is lossless because q is whatever it computed. `Int8Linear` runs
it with per-output-channel int8 weights (W ≈ s·W8, s = max|W_row| / 127) through fbgemm's dynamically
quantized GEMM (activations quantized per call to 7-bit unsigned ints, prepacked weights), which reads
4x fewer bytes than fp32 and has AVX2 int8 kernels: on the project CPU a 896->4864 draft matrix takes
0.27 / 0.65 / 1.1 ms for 1 / 4 / 8 rows against 0.84 / 1.3 / 2.5 ms with `aten._weight_int8pack_mm`
(bf16 activations, the fallback where no fbgemm/x86 quantized engine exists) and ~4x that in fp32.

Both keep the original fp32 weight, so `eager(model)` can switch a model back to plain nn.Linear
arithmetic (used to run transformers' own generate as a peer with the models as the user gave them).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

MANY_ROWS = 16  # the batch size oneDNN lays the multi-row copy out for; it serves 2..128 rows alike (table above)


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ + b through oneDNN's prepacked GEMM: one copy of W laid out for one row, one for many."""

    kernel = f"onednn 1 + {MANY_ROWS} rows"

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters, shared
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.enabled = True
        with torch.no_grad():
            w = linear.weight.detach()
            self.one = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            self.many = torch.ops.mkldnn._reorder_linear_weight(w, MANY_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features).contiguous()
        packed = self.one if len(x2) == 1 else self.many
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(torch.nn.Module):
    """y ≈ x (s·W8)ᵀ + b with int8 W8 [out, in] and per-row scales s [out] (a draft-only kernel)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.enabled = True
        with torch.no_grad():
            w = linear.weight.detach().float()
            s = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            w8 = torch.round(w / s[:, None]).clamp(-127, 127)
            self.packed = _fbgemm_pack(w8.to(torch.int8), s, linear.bias)  # None: no fbgemm here
            self.kernel = "int8pack" if self.packed is None else "fbgemm"
            if self.packed is None:
                self.register_buffer("w8", w8.to(torch.int8), persistent=False)
                self.register_buffer("scales", s.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None:  # reduce_range: 7-bit activations, so AVX2's int16 pair sums cannot saturate
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, True).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.w8, self.scales).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _fbgemm_pack(w8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's prepacked int8 weight, or None where this torch has no x86/fbgemm quantized engine (the
    quantized-tensor API is deprecated in torch; when it goes, the draft falls back to int8pack)."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the deprecation notice of quantized tensors
            zero_points = torch.zeros(len(w8), dtype=torch.long)
            qw = torch._make_per_channel_quantized_tensor(w8, scales.double(), zero_points, 0)
            return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
    except (AttributeError, RuntimeError):
        return None


def can_pack(model: torch.nn.Module) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: torch.nn.Module, kind: type[torch.nn.Module] = PackedLinear) -> int:
    """Replace every nn.Linear of a CPU fp32 model by `kind` (PackedLinear or Int8Linear); returns the count."""
    if not can_pack(model):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, kind(child))
                count += 1
    return count


def linear_kinds(model: torch.nn.Module) -> str:
    """Which matmul kernels a model runs (e.g. 'Int8Linear[fbgemm]' after pack_linears): they set its speed."""
    return ",".join(sorted({type(m).__name__ + (f"[{m.kernel}]" if hasattr(m, "kernel") else "")
                            for m in model.modules() if type(m).__name__.endswith("Linear")}))


@contextmanager
def eager(*models: torch.nn.Module | None) -> Iterator[None]:
    """Run the models with plain nn.Linear arithmetic inside the block."""
    fast = [m for model in models if model is not None for m in model.modules()
            if isinstance(m, (PackedLinear, Int8Linear))]
    for m in fast:
        m.enabled = False
    try:
        yield
    finally:
        for m in fast:
            m.enabled = True
