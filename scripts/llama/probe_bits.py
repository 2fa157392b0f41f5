import sys
import time

import llama_cpp as L
import numpy as np

path = sys.argv[1]
L.llama_backend_init()


def run(extra, fa):
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = extra
    model = L.llama_model_load_from_file(path.encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    V = L.llama_vocab_n_tokens(vocab)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 512, 512, 4
    cp.n_threads = cp.n_threads_batch = 2
    cp.kv_unified = True
    cp.flash_attn_type = fa
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)

    def decode(rows):
        b = L.llama_batch_init(len(rows), 0, 4)
        b.n_tokens = len(rows)
        for i, (tok, pos, seqs, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, len(seqs), int(want)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        assert L.llama_decode(ctx, b) == 0
        out = {
            i: np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy()
            for i, r in enumerate(rows)
            if r[3]
        }
        L.llama_batch_free(b)
        return out

    text = b"def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n"
    toks = (L.llama_token * 256)()
    n = L.llama_tokenize(vocab, text, len(text), toks, 256, True, True)
    prompt = list(toks[:n])
    P = len(prompt)
    decode([(t, p, [0], False) for p, t in enumerate(prompt)])
    cont = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600]
    ref = decode([(cont[0], P, [0], True)])[0]
    L.llama_memory_seq_rm(mem, 0, P, -1)
    # second row reference: chain of 2 decoded one at a time
    decode([(cont[0], P, [0], False)])
    ref2 = decode([(cont[1], P + 1, [0], True)])[0]
    L.llama_memory_seq_rm(mem, 0, P, -1)
    res = []
    for k in (5, 6, 7, 8):
        got = decode([(cont[i], P + i, [0], True) for i in range(k)])
        L.llama_memory_seq_rm(mem, 0, P, -1)
        res.append((k, float(np.abs(got[0] - ref).max()), float(np.abs(got[1] - ref2).max())))
    times = {}
    for k in (1, 3, 5, 6, 7, 8):
        ts = []
        for _ in range(4):
            t0 = time.perf_counter()
            decode([(cont[i], P + i, [0], i == k - 1) for i in range(k)])
            ts.append(time.perf_counter() - t0)
            L.llama_memory_seq_rm(mem, 0, P, -1)
        times[k] = round(min(ts) * 1000, 1)
    print(f"extra_bufts={extra} fa={fa}: row0/row1 max|block - alone| per k {res}\n   t(n) ms {times}", flush=True)
    L.llama_free(ctx)
    L.llama_model_free(model)


for extra, fa in ((False, 1),):
    run(extra, fa)
