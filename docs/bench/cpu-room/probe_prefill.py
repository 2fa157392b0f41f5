"""Prefill time of a long prompt in contexts of one model: ours (FA, Q8_0/F16), without FA (Q8_0/F16), llama.cpp's default (F16/F16, no FA)."""
import sys, time
import llama_cpp as L
path = sys.argv[1]; N = int(sys.argv[2])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
def make(fa, tk, tv, ub):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, ub, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = getattr(L, f"GGML_TYPE_{tk}"), getattr(L, f"GGML_TYPE_{tv}")
    return L.llama_init_from_model(model, cp)
configs = {"ours FA Q8_0/F16 ub256": (True, "Q8_0", "F16", 256), "noFA Q8_0/F16 ub512": (False, "Q8_0", "F16", 512),
           "noFA Q8_0/F16 ub256": (False, "Q8_0", "F16", 256), "default noFA F16/F16 ub512": (False, "F16", "F16", 512)}
ctxs = {k: make(*v) for k, v in configs.items()}
def prefill(ctx):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    t0 = time.perf_counter()
    for i in range(0, N, 512):
        n = min(512, N - i)
        b = L.llama_batch_init(n, 0, 1); b.n_tokens = n
        for j in range(n):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = (13 * (i + j)) % 30000, i + j, 1, i + j == N - 1
            b.seq_id[j][0] = 0
        assert L.llama_decode(ctx, b) == 0; L.llama_batch_free(b)
    return time.perf_counter() - t0
res = {k: [] for k in ctxs}
for r in range(3):
    for k, c in ctxs.items():
        res[k].append(prefill(c))
for k, v in res.items():
    print(f"N={N} {k}: median {sorted(v)[1]:.2f}s {['%.2f' % x for x in v]}", flush=True)
