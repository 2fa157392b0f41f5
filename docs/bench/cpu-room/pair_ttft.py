"""Streaming TTFT of `speculor serve` and llama-server on the same prompts, asked alternately (both servers up, one
computing at a time; 8 tokens each): `python pair_ttft.py <our url> <llama-server url> [first] [last]` over the
loadtest's MT-Bench/HumanEval/summarize prompts first..last."""
import asyncio, sys, statistics, httpx
from speculor.bench import prompts as P
from speculor.bench.loadtest import stream_chat
ours, theirs = sys.argv[1], sys.argv[2]
first, last = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (0, 16)
ps = [p.text for p in P.load(["mtbench", "humaneval", "summarize"], last)][first:]
async def main():
    res = {ours: [], theirs: []}
    async with httpx.AsyncClient(timeout=600) as c:
        for i, p in enumerate(ps):
            row = []
            for url in ((ours, theirs) if i % 2 else (theirs, ours)):
                r = await stream_chat(c, url, p, 8, None)
                res[url].append(r.ttft_s); row.append(f"{url[-4:]} ttft {r.ttft_s:.2f} lat {r.latency_s:.2f} tok {r.tokens}")
            print(i, " | ".join(row), flush=True)
    for u, v in res.items(): print(u, "TTFT p50", round(statistics.median(v), 2), "sum", round(sum(v), 2))
asyncio.run(main())
