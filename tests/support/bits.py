"""Run in a fresh interpreter by tests/test_llama_bits.py (ggml reads its tiled-matmul switch once per process, and
the negative control loads ggml's CPU backend as released through LD_PRELOAD): per embedded GGUF, the class its
calls="exact" load check chose and runtime/llama/bits.py's `differences` after 10 and 700 tokens of context, for
calls of 1 to 24 rows. Prints one JSON object; `--table` prints it as Markdown too."""

from __future__ import annotations

import json
import sys

from speculor.runtime.embedded import ensure_gguf
from speculor.runtime.llama import bits
from speculor.runtime.llama.model import LlamaModel

MODELS = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
CONTEXTS = (10, 700)
SIZES = range(1, 25)


def main() -> None:
    out = {}
    for name in MODELS:
        model = LlamaModel(ensure_gguf(name), threads=2, calls="exact", n_ctx=2048)
        out[name] = {"calls": model.calls,
                     **{str(c): bits.differences(model, c, SIZES) for c in CONTEXTS}}
        del model
    if "--table" in sys.argv:
        print(f"| model | calls | context | {' | '.join(map(str, SIZES))} |", file=sys.stderr)
        print(f"|---|---|---|{'---|' * len(SIZES)}", file=sys.stderr)
        for name, got in out.items():
            for c in CONTEXTS:
                row = " | ".join("=" if d == 0 else f"{d:.2g}" for d in got[str(c)].values())
                print(f"| {name} | {got['calls']} | {c} | {row} |", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
