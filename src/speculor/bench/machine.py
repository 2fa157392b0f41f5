"""How busy the machine is besides us: the load average, and the CPU other processes take during a measurement.

On Linux `/proc/stat` counts the whole machine's busy CPU time and `os.times()` our own process's (all its
threads); their difference over a wall interval is the number of cores other processes kept busy meanwhile.
A benchmark on a shared 2-core machine is only as good as that number is small.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MIN_WALL_S = 1.0  # below this the clock ticks of /proc/stat (10 ms) make the share meaningless


@dataclass(frozen=True)
class Snapshot:
    wall: float  # perf_counter seconds
    busy: float | None  # CPU seconds the whole machine spent busy since boot (None: no /proc/stat)
    own: float  # CPU seconds this process spent (user + system, all threads)


def snapshot() -> Snapshot:
    t = os.times()
    return Snapshot(time.perf_counter(), _machine_busy_s(), t.user + t.system)


def _machine_busy_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu  user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    ticks = [int(x) for x in fields[1:]]
    return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / TICK


def others_cores(before: Snapshot, after: Snapshot, also_ours: float | None = None) -> float | None:
    """Mean number of cores other processes kept busy between two snapshots; None where it cannot be told
    (no /proc/stat, or an interval too short for the clock ticks). `also_ours`: CPU seconds of a process that
    worked for us meanwhile (a peer server's), not counted as another's."""
    wall = after.wall - before.wall
    if before.busy is None or after.busy is None or wall < MIN_WALL_S:
        return None
    return max(0.0, (after.busy - before.busy) - (after.own - before.own) - (also_ours or 0.0)) / wall


def load_at_start(sample_s: float = 1.0) -> dict[str, float | None]:
    """The 1-minute load average, the core count, and the cores other processes use over a short sample."""
    before = snapshot()
    time.sleep(sample_s)
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    return {"load_avg_1m": load1, "cores": os.cpu_count(), "others_cores": others_cores(before, snapshot())}
