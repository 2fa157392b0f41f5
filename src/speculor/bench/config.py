"""`BenchConfig`: the options of one `speculor bench` run, validated once, frozen (built by commands/bench.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculor.bench.specs import Spec, parse_strategies
from speculor.errors import SpeculorError

# every strategy; Sequoia and DySpec size their trees from this machine's cost profile (their hardware-aware mode)
ALL = ("plain,default,chain:k=4,specinfer,sequoia:budget=auto,ngram,ngram-mod,suffix,dyspec:budget=auto,topk-tree,gsd,"
       "specdecpp,eagle,specinfer:drafters=boosted")
# the realistic default: >= 8 prompts of the sets' categories, 128 new tokens, 3 rounds
DEFAULTS = {"strategies": "plain,default,chain:k=4,dyspec:budget=auto", "limit": 8, "max_new_tokens": 128,
            "temperatures": "0", "rounds": 3}
# --quick: one MT-Bench and one HumanEval prompt, one round, so that every strategy and the peers fit in ~10 minutes;
# of the peers only those that run beside the loaded pair are kept (`BenchConfig.fit_peers`, bench/peers.py `unfit`)
QUICK = {"strategies": ALL + ",llama.cpp,hf-assisted,hf-prompt-lookup,llama-server,llama-server:ngram-mod,"
                        "llama-server:draft", "limit": 2, "max_new_tokens": 32,
         "temperatures": "0", "rounds": 1}
QUICK_NOTE = ("--quick decodes 2 prompts x 32 tokens in one round: prefill weighs 20-25% there and one noisy moment "
              "moves a ratio by 10% or more; its ratios are indicative only (realistic runs: --limit 8 "
              "--max-new-tokens 128 --rounds 3)")


@dataclass(frozen=True)
class BenchConfig:
    """strategies: plain first; temperatures: the single-stream run's (the batch run measures the first one);
    batch: batch sizes (--batch), None for the single-stream run; out: the folder for records, summary, table;
    fit_peers: drop the peers that cannot run beside the loaded pair (--quick's own list: the strategies not given);
    llama_server: the llama-server peers' binary (--llama-server; None: bench/peer_server.py `find_binary`'s)."""

    strategies: tuple[Spec, ...]
    sets: tuple[str, ...] = ("mtbench", "humaneval")
    limit: int = DEFAULTS["limit"]
    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    temperatures: tuple[float, ...] = (0.0,)
    top_p: float = 1.0
    rounds: int = DEFAULTS["rounds"]
    seed: int = 1234
    out: str | None = None
    format: str = "speculor"
    batch: tuple[int, ...] | None = None
    quick: bool = False
    fit_peers: bool = False
    llama_server: str | None = None

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise SpeculorError(f"--rounds takes a count >= 1, got {self.rounds}")
        if self.batch is not None and (not self.batch or any(b < 1 for b in self.batch)):
            raise SpeculorError(f"--batch takes batch sizes >= 1, got {self.batch!r}")

    @staticmethod
    def from_args(args: Any) -> BenchConfig:
        """From the parsed options of `speculor bench` (cli.add_bench_arguments); options left None take the
        --quick values (with --quick) or the defaults."""
        given = {k: v for k, v in vars(args).items() if v is not None}
        opts = {**(QUICK if given.get("quick") else DEFAULTS), **given}
        try:
            batch = tuple(sorted({int(b) for b in str(opts["batch"]).split(",")})) if opts.get("batch") else None
            temps = tuple(float(t) for t in str(opts["temperatures"]).split(","))
        except ValueError as exc:
            raise SpeculorError(f"bad number in --batch or --temperatures: {exc}") from None
        kept = {k: opts[k] for k in ("limit", "max_new_tokens", "top_p", "rounds", "seed", "out", "format", "quick",
                                     "llama_server")
                if k in opts}  # the others keep the defaults above
        if "sets" in opts:
            kept["sets"] = tuple(opts["sets"].split(","))
        fit = bool(given.get("quick")) and "strategies" not in given
        return BenchConfig(tuple(parse_strategies(opts["strategies"])), temperatures=temps, batch=batch,
                           fit_peers=fit, **kept)

    def meta(self) -> dict[str, Any]:
        """The run's options as summary.json records them."""
        return {"strategies": ",".join(s.label for s in self.strategies), "sets": ",".join(self.sets),
                "limit": self.limit, "max_new_tokens": self.max_new_tokens,
                "temperatures": ",".join(f"{t:g}" for t in self.temperatures), "top_p": self.top_p,
                "rounds": self.rounds, "seed": self.seed, "out": self.out, "format": self.format,
                "batch": ",".join(map(str, self.batch)) if self.batch else None, "quick": self.quick,
                "llama_server": self.llama_server}
