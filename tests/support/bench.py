"""The options of `speculor bench` for the bench tests."""

from __future__ import annotations

import argparse

from speculor.bench.config import BenchConfig
from speculor.cli import add_bench_arguments


def bench_config(*argv: str) -> BenchConfig:
    """The options of `speculor bench`, parsed as the CLI parses them (argparse lives in the CLI only)."""
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return BenchConfig.from_args(p.parse_args(list(argv)))
