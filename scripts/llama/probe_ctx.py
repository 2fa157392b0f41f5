import time

import llama_cpp as L
import numpy as np

L.llama_backend_init()
from speculor.runtime.assets import cache_dir  # noqa: E402
from speculor.runtime.llama import _lib  # noqa: E402 (after llama.cpp's backend is up)

_lib()
path = str(cache_dir() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf")
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(path.encode(), mp)
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))


def ctx(threads, fa, tk=1, tv=1):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 1024, 256, 2
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    cp.flash_attn_type = fa
    cp.type_k = tk
    cp.type_v = tv
    return L.llama_init_from_model(model, cp)


def decode(c, rows):
    b = L.llama_batch_init(len(rows), 0, 2)
    b.n_tokens = len(rows)
    for i, (t, p, w) in enumerate(rows):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, w
        b.seq_id[i][0] = 0
    assert L.llama_decode(c, b) == 0
    out = {
        i: np.ctypeslib.as_array(L.llama_get_logits_ith(c, i), shape=(V,)).copy() for i, r in enumerate(rows) if r[2]
    }
    L.llama_batch_free(b)
    return out


rng = np.random.default_rng(0)

for threads, fa, tk, tv in ((2, 1, 1, 0), (2, 1, 8, 8)):
    res = []
    for n in (20, 64, 128, 200, 256, 337, 600):
        c = ctx(threads, fa, tk, tv)
        mem = L.llama_get_memory(c)
        toks = rng.integers(100, 20000, n + 2).tolist()
        decode(c, [(t, p, False) for p, t in enumerate(toks[:n])])
        t0 = time.perf_counter()
        a = decode(c, [(toks[n], n, True)])[0]
        dt = time.perf_counter() - t0
        L.llama_memory_seq_rm(mem, 0, n, -1)
        b = decode(c, [(toks[n], n, True), (toks[n + 1], n + 1, True)])[0]
        res.append((n, float(np.abs(a - b).max()), round(dt * 1000, 1)))
        L.llama_free(c)
    print(f"threads={threads} fa={fa} k={tk} v={tv}", res, flush=True)
