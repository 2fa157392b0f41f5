"""`--backend auto`: the backend whose measured cost curves predict the most tokens/s for a pair on this machine.

For each candidate (torch, and llama.cpp where the pair is GGUF, the device a CPU and llama-cpp-python installed)
the pair is loaded once and its cost curve measured (runtime/cost.py, cached). The prediction is the best chain
of k = 0..8 draft tokens under the pair's measured top-1 acceptance a (`acceptance`: the built-in Sequoia calibration
at T = 0):

    tokens/s(k) = (1 + a + ... + a^k) / (t_target(k + 1) + k t_draft(1)),   k = 0: plain decoding

The choice and both predictions are cached per machine, threads and pair, and said on stderr.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
from importlib import resources

from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.assets import cache_dir, slug

CHAIN = range(0, 9)


def predicted(cost, a: float) -> tuple[float, int]:
    """(tokens/s, k) of the best chain length k under top-1 acceptance a (module docstring)."""
    best = (0.0, 0)
    for k in CHAIN:
        rate = sum(a**i for i in range(k + 1)) / (cost.t_target(k + 1) + k * cost.t_draft(1))
        best = max(best, (rate, k))
    return best


def acceptance(target: str, draft: str) -> float:
    """Top-1 acceptance at T = 0: the built-in Sequoia calibration of this pair, else of the embedded pair."""
    cals = json.loads(resources.files("speculor").joinpath("data/sequoia_acc.json").read_text())["calibrations"]
    greedy = [c for c in cals if c["temperature"] == 0]
    cal = next((c for c in greedy if (c["target"], c["draft"]) == (target, draft)), greedy[0])
    return cal["counts"][0] / cal["steps"]


def candidates(target: str, draft: str | None, device: str) -> list[str]:
    from speculor.runtime import llama

    gguf = all(s in embedded.EMBEDDED or s.endswith(".gguf") for s in (target, draft) if s is not None)
    return ["torch"] + (["llama.cpp"] if gguf and device == "cpu" and llama.available() else [])


def choose(target: str, draft: str | None, *, device: str, threads: int) -> str:
    """The backend predicted fastest (module docstring); measured once per machine, threads and pair."""
    from speculor.runtime.cost import machine_cost
    from speculor.runtime.loading import load_pair

    target, draft = embedded.named(target, draft)
    names = candidates(target, draft, device)
    if len(names) == 1 or draft is None:
        return names[-1]
    path = cache_dir() / "choice" / f"{slug(target)}--{slug(draft)}--{slug(platform.node())}--x{threads}.json"
    if path.exists():
        record = json.loads(path.read_text())
    else:
        a = acceptance(target, draft)
        record = {"acceptance": a, "predicted": {}}
        for name in names:
            pair = load_pair(target, draft, device=device, backend=name, threads=threads)
            rate, k = predicted(machine_cost(pair), a)
            record["predicted"][name] = {"tokens_per_s": rate, "chain": k}
            del pair
            gc.collect()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    pred = record["predicted"]
    if not pred:
        raise SpeculorError(f"no backend could be measured for {target!r}")
    chosen = max(pred, key=lambda n: pred[n]["tokens_per_s"])
    said = ", ".join(f"{n} {p['tokens_per_s']:.1f} tokens/s (chain k={p['chain']})" for n, p in pred.items())
    print(f"speculor: --backend auto chose {chosen}: predicted {said} from the measured cost curves "
          f"(top-1 acceptance {record['acceptance']:.2f}; cached in {path})", file=sys.stderr)
    return chosen
