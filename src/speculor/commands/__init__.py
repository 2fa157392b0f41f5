"""What each `speculor` command does, given its parsed arguments: one module per command, each with its `run(args)`
(the parser is cli.py's: argparse lives there); here, what they share.

Every heavy import (torch, transformers, the models) is made inside the command that needs it, so `speculor --help`
and `speculor loadtest` start without them. Nothing below the command line imports this package.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speculor.runtime.backend import Pair
    from speculor.runtime.spec import PairSpec

Args = Any  # the argparse.Namespace of the command

# The registered strategies and, per strategy option of `generate` and `serve`, the strategies that take it, as
# `speculor.drafters.registry` says (BUILDERS, options_of; tests/test_cli.py checks that they agree). Spelled out
# here so that `--help` needs no import of the registry, which imports torch.
STRATEGIES = ("default", "plain", "chain", "sequoia", "specinfer", "ngram", "ngram-mod", "specdecpp", "dyspec",
              "topk-tree", "gsd", "eagle", "suffix")
TAKEN_BY = {
    "k": ("chain", "ngram", "topk-tree", "gsd"),
    "budget": ("default", "sequoia", "ngram", "specdecpp", "dyspec", "topk-tree", "gsd", "eagle", "suffix"),
    "depth": ("sequoia", "dyspec", "topk-tree", "gsd", "eagle"),
    "width": ("sequoia",),
    "acc": ("sequoia",),
    "threshold": ("specdecpp", "dyspec", "eagle"),
    "head": ("specdecpp",),
    "heads": ("specinfer", "eagle"),
    "k_min": ("specdecpp",),
    "k_max": ("specdecpp",),
}

# `speculor serve`'s Ray Serve options, each a field of serving.ray_config.RaySettings (cli.py adds them)
RAY_ARGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "replica_cpus", "replica_memory_gib",
            "replica_gpus", "max_queued_requests", "drain_s")

# the pair's options as the command line and RaySettings name them (`PairSpec.named`), with their defaults
PAIR_OPTIONS = {"backend": "auto", "device": "cpu", "dtype": "auto", "kernels": "fast", "threads": None,
                "calls": "exact", "draft_vocab": None, "offload": False, "context": None}


def check_options(strategy: str, options: dict) -> None:
    """The registry's check of a strategy's name and options, run before a model is loaded (imports torch)."""
    from speculor.drafters.registry import check_options as check

    check(strategy, options)


def strategy_options(args: Args) -> dict:
    """The strategy options given on the command line (argparse dest names, e.g. k_min), checked against what
    args.strategy takes. Options not given are left out, so that the strategy's own defaults apply."""
    given = {n: getattr(args, n) for n in TAKEN_BY if getattr(args, n, None) is not None}
    check_options(args.strategy, given)
    return given


def pair_spec(args: Args) -> PairSpec:
    """The pair a command's arguments name (--target, --draft and the pair's options; a command without one of
    those options gets its default)."""
    from speculor.runtime.spec import PairSpec

    return PairSpec.named(args.target, args.draft, **{n: getattr(args, n, d) for n, d in PAIR_OPTIONS.items()})


def load(args: Args) -> Pair:
    """The pair a command's arguments name, loaded (backend auto chosen first: `speculor.load_pair`)."""
    from speculor.runtime.loading import load_pair

    return load_pair(pair_spec(args))


def print_peak_memory(device) -> None:
    """One stderr line: the process's peak memory so far (loading included; runtime/memory.py says what it counts)."""
    from speculor.runtime.memory import peak_memory_gib

    peak = peak_memory_gib(device)
    where = "GPU memory (torch's allocator)" if device.type == "cuda" else "resident memory"
    print(f"peak {where}: " + ("unknown on this OS" if peak is None else f"{peak:.2f} GiB"), file=sys.stderr)
