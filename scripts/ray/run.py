"""The real pair on this machine behind `speculor serve` and behind `speculor serve --ray` (1 and 2 replicas), each
started as a user starts it, one at a time: `speculor loadtest`'s rounds (a reference round of every prompt alone,
then 1, 4 and 16 concurrent clients), in `--repeats` interleaved rounds. Writes results.json (rows per server and
repeat, and each server's answers) and prints a table with the Ray path's throughput over the direct server's.

    .venv/bin/python scripts/ray/run.py --repeats 3        # writes docs/bench/cpu-ray/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from speculor.bench import loadtest, prompts

SERVE = [sys.executable, "-m", "speculor.cli", "serve", "--backend", "llama.cpp", "--port", "8011"]
SERVERS = {  # name: extra arguments
    "direct": ["--threads", "2"],
    "ray, 1 replica": ["--ray", "--threads", "2"],
    "ray, 2 replicas (1 thread each)": ["--ray", "--replicas", "2", "--threads", "1"],
}
ONE_THREAD = {  # --one-thread: a core left for Ray's own processes
    "direct, 1 thread": ["--threads", "1"],
    "ray, 1 replica, 1 thread": ["--ray", "--threads", "1"],
}
URL = "http://127.0.0.1:8011"


def started(args: list[str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(SERVE + args, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(URL + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"the server exited: see {log}"
        time.sleep(2)
    raise TimeoutError(f"the server did not start: see {log}")


def idle_cpu(proc: subprocess.Popen, seconds: float = 20.0) -> float:
    """CPU the server and every process it started (Ray's) use while no request runs, in cores."""

    def total() -> float:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        busy = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                busy += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return busy

    before = total()
    time.sleep(seconds)
    return (total() - before) / seconds


def stopped(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # drains, then stops Ray
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60  # Ray's own processes end after the driver: the next server starts after them
    while any(p.info["name"] in ("raylet", "gcs_server") for p in psutil.process_iter(["name"])):
        assert time.monotonic() < deadline, "Ray did not stop"
        time.sleep(1)
    time.sleep(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one-thread", action="store_true", help="the ONE_THREAD servers instead of SERVERS")
    ap.add_argument("--out", default=str(Path(__file__).parents[2] / "docs" / "bench" / "cpu-ray" / "results.json"))
    a = ap.parse_args()
    texts = [p.text for p in prompts.load(["mtbench", "humaneval"], 16)]
    clients = [int(c) for c in a.clients.split(",")]
    runs: list[dict] = []
    servers = ONE_THREAD if a.one_thread else SERVERS
    for repeat in range(a.repeats):
        for name, args in servers.items():
            metrics = ["--metrics-port", str(8200 + len(runs))] if "--ray" in args else []  # a fresh port each
            proc = started(args + metrics, Path(f"/tmp/speculor-cpu-ray-serve-{len(runs)}.log"))
            try:
                idle = idle_cpu(proc)
                answers: dict[str, str] = {}
                rows = loadtest.run(URL, texts, clients, max_tokens=a.max_tokens, reference=True, answers=answers)
            finally:
                stopped(proc)
            runs.append({"server": name, "repeat": repeat, "rows": rows, "answers": answers, "idle_cpu": idle})
            speeds = ", ".join(
                f"{r['clients']}{'r' if r.get('reference') else ''}: {r['throughput_tokens_per_s']:.1f}" for r in rows
            )
            print(f"repeat {repeat} {name} (idle: {idle:.3f} cores): {speeds} tok/s", flush=True)
            Path(a.out).write_text(json.dumps(runs, indent=1) + "\n")
    print(table(runs))


def table(runs: list[dict]) -> str:
    """Median throughput (min-max over repeats) per server and concurrency, and the ratio to the direct server's
    (with as many threads) throughput of the same repeat."""
    first = runs[0]["answers"]
    lines = [
        "| server | clients | tokens/s, median (min-max) | x direct, median (min-max) | answers differing "
        "(in the run / from direct) |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == name]
        for i, row in enumerate(mine[0]["rows"]):
            label = "1 (one by one)" if row.get("reference") else str(row["clients"])
            tps = [r["rows"][i]["throughput_tokens_per_s"] for r in mine]
            base = "direct, 1 thread" if name.endswith("1 thread") else "direct"
            ratios = [
                r["rows"][i]["throughput_tokens_per_s"] / d["rows"][i]["throughput_tokens_per_s"]
                for r in mine
                for d in runs
                if d["server"] == base and d["repeat"] == r["repeat"]
            ]
            inside = sum(r["rows"][i]["answers_differing"] for r in mine)
            across = sum(r["answers"][p] != first[p] for r in mine for p in first)
            lines.append(
                f"| {name} | {label} | {statistics.median(tps):.2f} ({min(tps):.2f}-{max(tps):.2f}) | "
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | {inside} / "
                f"{across} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
