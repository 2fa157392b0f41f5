"""`speculor bench`: strategies against plain decoding on real prompts (bench/run.py)."""

from __future__ import annotations

from speculor import commands
from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
    from speculor.bench.config import BenchConfig
    from speculor.bench.peer_server import find_binary
    from speculor.bench.peers import PEERS, SERVER_PEERS
    from speculor.bench.run import run as run_bench

    cfg = BenchConfig.from_args(args)
    if not cfg.fit_peers and any(s.name in SERVER_PEERS for s in cfg.strategies):
        find_binary(cfg.llama_server)  # no binary: said before the pair is loaded
    for spec in cfg.strategies:  # refused before the pair is loaded
        if spec.name in PEERS:
            if spec.options:
                raise SpeculorError(f"{spec.label!r}: the peer {spec.name!r} takes no options")
        else:
            commands.check_options(spec.name, spec.options)
    run_bench(cfg, lambda: commands.load(args))
