"""t(k) of one call on the exact class today: a chain of k rows of one request, or k requests one row each (three
requests of 450 cells resident); two rounds."""
import time, statistics
from speculor import load_pair
from speculor.runtime.backend import Block, forward1
pair = load_pair(backend="llama.cpp", threads=2, draft=None)
T = pair.target
def fill(n, base):
    c = T.new_cache(); toks = [100 + (base * 7919 + i * 31) % 30000 for i in range(n)]
    forward1(T, c, toks, last=True); c.keep(list(range(n)))
    return c
def steps(make, keep, k=10):
    ts = []
    for _ in range(k):
        blocks = make()
        t0 = time.perf_counter(); T.forward(blocks); ts.append(time.perf_counter() - t0)
        keep()
    return statistics.median(ts)
own = [fill(450, i) for i in range(3)]
def k1(cs): 
    for c in cs: c.keep([0])
for rnd in range(2):
    t1 = steps(lambda: [Block(own[0], [1000])], lambda: k1(own[:1]))
    tc2 = steps(lambda: [Block(own[0], [1000, 1001])], lambda: own[0].keep([0, 1]))
    tc3 = steps(lambda: [Block(own[0], [1000, 1001, 1002])], lambda: own[0].keep([0, 1, 2]))
    tm2 = steps(lambda: [Block(c, [1000]) for c in own[:2]], lambda: k1(own[:2]))
    tm3 = steps(lambda: [Block(c, [1000]) for c in own], lambda: k1(own))
    print(f"t1 {t1*1e3:.1f}  chain2 {tc2/t1:.2f}x chain3 {tc3/t1:.2f}x  two requests {tm2/t1:.2f}x three {tm3/t1:.2f}x (cells {T.used})", flush=True)
