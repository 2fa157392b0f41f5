"""Faster CPU matmuls holding each weight once: prepacked fp32 oneDNN weights for the target, int8 for the draft.

A Linear's cost on a CPU depends on the kernel far more than on the number of rows (the measurements behind every
choice here: docs/bench/README.md, "Kernels"). `PackedLinear` holds each weight once, in oneDNN's multi-row layout,
and releases the fp32 original. A block of fewer than MIN_ROWS rows is padded with zero rows to MIN_ROWS: that
layout's kernel is slow for 1-4 rows and at its best for 5-6, so one copy is both the fastest and the smallest.
Every block is fp32 arithmetic of the same weights, equal to nn.Linear up to summation order, and a row's output
does not depend on the other rows of its block (tests/test_kernels.py), so a padded row is the row alone.
`pack_linears(model)` swaps every nn.Linear of a CPU fp32 model for one and frees the fp32 weight (a view of the
mapped safetensors file also gives its pages back); the embedding table stays, the lookup needs it.

The draft only proposes: any draft is lossless because q is whatever it computed. `Int8Linear` runs it with
per-output-channel int8 weights (W ≈ s·W8, s = max|W_row| / 127) through fbgemm's dynamically quantized GEMM
(activations quantized per call to 7-bit unsigned ints, prepacked weights), which reads 4x fewer bytes than fp32;
`aten._weight_int8pack_mm` (bf16 activations) is the fallback where no fbgemm/x86 quantized engine exists.

Rows apart (`scale_rows`, `Int8Linear.scaled`): fbgemm picks the activations' quantization step from the whole
call's range, so one row's result depends on the rows beside it. Where that matters (a sampled request's draft rows
stacked with other requests': its q, hence its sample, must follow from its own tokens) each row is divided by its
own absmax a_i first and two sentinel rows of +1 and -1 join the call: every call then spans exactly [-1, 1], the
step is the same in every call, and y_i = a_i · (W8 x_i / a_i) is computed from row i alone, bit for bit, at the
cost of the scaling ops. Its error against fp32 is that of per-row quantization.

Neither keeps the fp32 weight, so a packed model can no longer run plain nn.Linear arithmetic: transformers'
generate (bench/peers.py) loads the untouched models again from disk for its call.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from speculor.errors import SpeculorError
from speculor.runtime.memory import drop_file_pages

MANY_ROWS = 16  # the batch size oneDNN lays the weight out for (2, 4 or 8 give the same layout)
MIN_ROWS = 5  # blocks of fewer rows are padded to this many: the kernel is faster for 5 rows than for 1 (above)


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ + b through oneDNN's GEMM over W prepacked once for blocks of `rows` rows; the fp32 W is not kept.

    A block of fewer than `min_rows` rows runs padded with zero rows to `min_rows` (their outputs dropped).
    """

    def __init__(self, linear: torch.nn.Linear, rows: int = MANY_ROWS, min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        if rows < 1 or min_rows < 1:
            raise SpeculorError(f"PackedLinear needs rows >= 1 and min_rows >= 1, got {rows}, {min_rows}")
        self.bias = linear.bias  # the same Parameter (small), shared
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = min_rows
        self.kernel = f"onednn {rows} rows"
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        n = len(x2)
        if n < self.min_rows:
            x2 = torch.cat([x2, x2.new_zeros(self.min_rows - n, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:n].reshape(*x.shape[:-1], self.out_features)


class Int8Linear(torch.nn.Module):
    """y ≈ x (s·W8)ᵀ + b with int8 W8 [out, in] and per-row scales s [out]: a draft-only kernel; W is not kept."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            w = linear.weight.detach().float()
            s = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            w8 = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            del w
            self.packed = _fbgemm_pack(w8, s, linear.bias)  # None: no fbgemm here
            self.kernel = "int8pack" if self.packed is None else "fbgemm"
            if self.packed is None:
                self.register_buffer("w8", w8, persistent=False)
                self.register_buffer("scales", s.to(torch.bfloat16), persistent=False)

    def scaled(self, rows: Scaled) -> torch.Tensor:
        """This layer's output for `scale_rows(x)`: each row computed from itself alone (module docstring)."""
        if self.packed is None:  # int8pack: activations are not quantized, a row's output is its own already
            return self.forward(rows.x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            y = torch.ops.quantized.linear_dynamic(rows.xs, self.packed, True)[:len(rows.x)]  # W8 x/a + b
        y = y.mul_(rows.a) if self.bias is None else torch.addcmul(self.bias, y.sub_(self.bias), rows.a)
        return y.reshape(*rows.x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None:  # reduce_range: 7-bit activations, so AVX2's int16 pair sums cannot saturate
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, True).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.w8, self.scales).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Scaled(NamedTuple):
    """A linear input x [..., K] with its rows scaled apart: xs = [x_i / a_i ; +1 ; -1] [m + 2, K], a [m, 1]."""

    x: torch.Tensor
    xs: torch.Tensor
    a: torch.Tensor


def scale_rows(x: torch.Tensor) -> Scaled:
    """x's rows divided by their absmax, and the sentinel rows that fix every call's range to [-1, 1]."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    a = torch.linalg.vector_norm(x2, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)
    sentinels = x2.new_tensor([[1.0], [-1.0]]).expand(2, x2.shape[1])
    return Scaled(x, torch.cat([x2 / a, sentinels]), a)


def apply(linear: torch.nn.Module, rows: Scaled) -> torch.Tensor:
    """linear(rows.x), each row's output computed from that row alone by Int8Linear's `scaled`; any other kernel is
    called as it is (PackedLinear's rows are apart already, tests/test_kernels.py)."""
    return linear.scaled(rows) if isinstance(linear, Int8Linear) else linear(rows.x)


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
    """Replace every nn.Linear of a CPU fp32 model by `kind` (PackedLinear or Int8Linear); returns the count.

    Each Linear goes as soon as it is replaced, so its fp32 weight is freed then (unless something else holds it,
    e.g. an input embedding tied to the output layer) and the peak is the model plus one matrix, not two models.
    A weight that is a view of a mapped safetensors file has its pages unmapped (`memory.drop_file_pages`): they
    would otherwise stay resident until the whole file is unmapped, which the kept embedding table prevents. A tied
    head's weight is the embedding table: packing read all of it, the lookups read a few rows a step, so its pages go
    too and fault in again from the file row by row.
    """
    if not can_pack(model):
        return 0
    places = [(module, name) for module in model.modules() for name, child in module.named_children()
              if type(child) is torch.nn.Linear]
    done: dict[int, torch.nn.Module] = {}  # a linear several parents hold (lean.fuse_projections' Parts) packs once
    for module, name in places:
        linear = getattr(module, name)
        if id(linear) not in done:
            done[id(linear)] = kind(linear)
            drop_file_pages(linear.weight)  # mapped from a safetensors file: its pages were read to pack it
        setattr(module, name, done[id(linear)])
        del linear  # the old Linear's last reference (unless its weight is shared, e.g. tied to the embedding)
    return len(done)


def is_packed(model: torch.nn.Module) -> bool:
    """True when pack_linears swapped some of the model's linears (their fp32 weights are gone)."""
    return any(isinstance(m, (PackedLinear, Int8Linear)) for m in model.modules())


def linear_kinds(model: torch.nn.Module) -> str:
    """Which matmul kernels a model runs (e.g. 'Int8Linear[fbgemm]' after pack_linears): they set its speed."""
    return ",".join(sorted({type(m).__name__ + (f"[{m.kernel}]" if hasattr(m, "kernel") else "")
                            for m in model.modules() if type(m).__name__.endswith("Linear")}))
