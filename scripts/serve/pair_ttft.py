"""Streaming TTFT of several servers on the same prompts, asked in rotation (all servers up, one computing at a time;
8 tokens each): `python scripts/serve/pair_ttft.py <url>,<url>[,...] [first] [last]` over the loadtest's
MT-Bench/HumanEval/summarize prompts first..last; the last URL is the reference of the per-prompt ratios."""

import asyncio
import statistics
import sys

import httpx

from speculor.bench import prompts as P
from speculor.bench.loadtest import stream_chat

urls = sys.argv[1].split(",")
first, last = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0, 16)
ps = [p.text for p in P.load(["mtbench", "humaneval", "summarize"], last)][first:]


async def main():
    res = {u: [] for u in urls}
    async with httpx.AsyncClient(timeout=600) as c:
        for i, p in enumerate(ps):
            row = {}
            for url in urls[i % len(urls) :] + urls[: i % len(urls)]:
                r = await stream_chat(c, url, p, 8, None)
                res[url].append(r.ttft_s)
                row[url] = r.ttft_s
            print(i, len(p), " ".join(f"{u[-4:]} {row[u]:.2f}" for u in urls), flush=True)
    for u, v in res.items():
        print(
            u,
            "TTFT p50",
            round(statistics.median(v), 2),
            "sum",
            round(sum(v), 2),
            "÷ last p50",
            round(statistics.median([a / b for a, b in zip(v, res[urls[-1]], strict=False)]), 2),
        )


asyncio.run(main())
