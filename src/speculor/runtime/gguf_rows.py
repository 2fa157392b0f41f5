"""`GGUFRows`: rows of one tensor of a GGUF file (a token embedding, an output matrix), dequantised on demand by
gguf's own dequantisation and remembered: what a head over a llama.cpp target reads of its weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from speculor.errors import SpeculorError


class GGUFRows:
    """Rows of one tensor of a GGUF file, dequantised on demand (gguf's own dequantisation) and remembered."""

    def __init__(self, path: str | Path, names: Sequence[str]) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        found = {t.name: t for t in reader.tensors}
        name = next((n for n in names if n in found), None)
        if name is None:
            raise SpeculorError(f"{path} has none of the tensors {list(names)}")
        self.tensor, self.rows = found[name], {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        wanted = [int(i) for i in ids.tolist()]
        missing = sorted({i for i in wanted if i not in self.rows})
        if missing:
            data = np.asarray(self.tensor.data)
            rows = dequantize(data[missing], self.tensor.tensor_type)
            for i, row in zip(missing, rows, strict=True):
                self.rows[i] = torch.from_numpy(np.array(row, dtype=np.float32))
        return torch.stack([self.rows[i] for i in wanted])
