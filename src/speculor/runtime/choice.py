"""`--backend auto`: the backend whose measured cost curves predict the most tokens/s for a pair on this machine.

For each candidate (torch, and llama.cpp where the pair is GGUF, the device a CPU and llama-cpp-python installed)
the pair is loaded once and its cost curve measured (runtime/profiling.py, cached). The prediction is the best chain
of k = 0..8 draft tokens under the pair's measured top-1 acceptance a (`acceptance`: the built-in Sequoia calibration
at T = 0):

    tokens/s(k) = (1 + a + ... + a^k) / (t_target(k + 1) + k t_draft(1)),   k = 0: plain decoding

The choice and both predictions are cached per machine, threads and pair, and said on stderr. Where torch is the only
candidate (a GPU, a model that is not GGUF, llama-cpp-python missing, a torch-only option) nothing is measured: the
choice and why are said on stderr all the same.

Contract: `choose_backend(spec)` is the first stage's choice of "auto" (runtime/resolve.py): a device that cannot run
is refused before anything is measured. Measuring a candidate runs the other two stages on a plan of that backend
and PairSpec's default options (runtime/plan.py, prepare.py, load.py); none of those modules imports this one.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
from importlib import resources

import torch

from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.assets import cache_dir, slug
from speculor.runtime.load import load
from speculor.runtime.plan import check_device, make_plan
from speculor.runtime.prepare import prepare
from speculor.runtime.profiling import machine_cost
from speculor.runtime.spec import PairSpec

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


def torch_only(target: str, draft: str | None, device: str) -> str:
    """Why torch is the only candidate for this pair and device ('' where llama.cpp is one too); nothing is loaded."""
    if device != "cpu":
        return f"--device {device}: the llama.cpp backend runs on the CPU here"
    if not all(s in embedded.EMBEDDED or s.endswith(".gguf") for s in (target, draft) if s is not None):
        return "the llama.cpp backend runs GGUF files (an embedded model or a .gguf file), and this pair is not one"
    from speculor.runtime.llama.model import available

    if not available():
        return "the llama.cpp backend needs llama-cpp-python, which is not installed"
    return ""


def candidates(target: str, draft: str | None, device: str, calls: str = "exact") -> list[str]:
    """The backends that can run the pair; with --calls vector or batched (a llama.cpp setting) llama.cpp alone."""
    why = torch_only(target, draft, device)
    if calls != "exact":
        if why:
            raise SpeculorError(f"--calls {calls} is a llama.cpp setting, and {why}")
        return ["llama.cpp"]
    return ["torch"] if why else ["torch", "llama.cpp"]


def report_choice(chosen: str, why: str) -> str:
    """One stderr line: what auto chose and why; returns the choice."""
    print(f"speculor: --backend auto chose {chosen}: {why}", file=sys.stderr)
    return chosen


def choose(target: str, draft: str | None, *, device: str, threads: int, only_torch: str = "") -> str:
    """The backend predicted fastest (module docstring); measured once per machine, threads and pair. only_torch: why
    an option of the caller's needs torch (e.g. --draft-vocab), if one does."""
    target, draft = embedded.named(target, draft)
    why = only_torch or torch_only(target, draft, device)
    if why:
        return report_choice("torch", why + " (nothing measured)")
    if draft is None:
        return report_choice("llama.cpp", "no draft model: plain decoding, on the GGUF file's own quantized kernels "
                             "(nothing measured)")
    path = cache_dir() / "choice" / f"{slug(target)}--{slug(draft)}--{slug(platform.node())}--x{threads}.json"
    if path.exists():
        record = json.loads(path.read_text())
    else:
        record = measure(target, draft, device=device, threads=threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    pred = record["predicted"]
    if not pred:
        raise SpeculorError(f"no backend could be measured for {target!r}")
    chosen = max(pred, key=lambda n: pred[n]["tokens_per_s"])
    said = ", ".join(f"{n} {p['tokens_per_s']:.1f} tokens/s (chain k={p['chain']})" for n, p in pred.items())
    return report_choice(chosen, f"predicted {said} from the measured cost curves (top-1 acceptance "
               f"{record['acceptance']:.2f}; cached in {path})")


def measure(target: str, draft: str, *, device: str, threads: int) -> dict:
    """The record `choose` caches: the pair's acceptance and, per candidate, its predicted tokens/s and chain, each
    candidate loaded (plan, prepare and load, with PairSpec's default options) and released in turn."""
    a = acceptance(target, draft)
    record: dict = {"acceptance": a, "predicted": {}}
    for name in candidates(target, draft, device):
        pair = load(prepare(make_plan(PairSpec(target, draft, device=device, backend=name, threads=threads))))
        rate, k = predicted(machine_cost(pair), a)
        record["predicted"][name] = {"tokens_per_s": rate, "chain": k}
        del pair
        gc.collect()
    return record


def choose_backend(spec: PairSpec) -> str:
    """The backend "auto" stands for in `spec` (`choose`), once the device is checked (a device that cannot run is
    refused before anything is measured); with --calls vector or batched, llama.cpp unmeasured."""
    check_device(spec.device, spec.offload)
    if spec.calls != "exact":  # a llama.cpp setting: nothing to choose
        if spec.draft_vocab:
            raise SpeculorError(f"--calls {spec.calls} is a llama.cpp setting and --draft-vocab a torch one: give one")
        candidates(*embedded.named(spec.target, spec.draft), spec.device, spec.calls)
        return report_choice("llama.cpp", f"--calls {spec.calls} is a llama.cpp setting (nothing measured)")
    only_torch = "--draft-vocab restricts a torch draft's head" if spec.draft_vocab else ""
    return choose(spec.target, spec.draft, device=spec.device, threads=spec.threads or torch.get_num_threads(),
                  only_torch=only_torch)
