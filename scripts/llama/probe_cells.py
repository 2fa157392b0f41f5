"""Does a call's time grow with the cells the unified memory holds (graveyard, other requests), not its own context?"""

import sys
import time

import llama_cpp as L

path = sys.argv[1]
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(path.encode(), mp)
vocab = L.llama_model_get_vocab(model)
V = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 16384, 512, 256, 64
cp.n_threads = cp.n_threads_batch = 2
cp.kv_unified = True
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
cp.type_k, cp.type_v = L.GGML_TYPE_Q8_0, L.GGML_TYPE_F16
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)


def decode(rows):
    b = L.llama_batch_init(len(rows), 0, 8)
    b.n_tokens = len(rows)
    for i, (tok, pos, want, s) in enumerate(rows):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
        b.seq_id[i][0] = s
    assert L.llama_decode(ctx, b) == 0
    L.llama_batch_free(b)


P = 700
for i in range(0, P, 256):
    decode([((7 * p) % 5000, p, False, 0) for p in range(i, min(P, i + 256))])


def timeit(k):
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        decode([(11 + i, P + i, True, 0) for i in range(k)])
        ts.append(time.perf_counter() - t0)
        L.llama_memory_seq_rm(mem, 0, P, -1)
    return round(sorted(ts)[3] * 1000, 1)


print("cells ~700:", {k: timeit(k) for k in (1, 3, 4)}, flush=True)
for extra in (4000, 12000):
    have = L.llama_memory_seq_pos_max(mem, 63) + 1
    for i in range(have, extra, 256):
        decode([((3 * p) % 5000, p, False, 63) for p in range(i, min(extra, i + 256))])
    print(f"cells ~{700 + extra} (graveyard {extra}):", {k: timeit(k) for k in (1, 3, 4)}, flush=True)
