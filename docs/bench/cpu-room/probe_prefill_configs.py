"""Prefill of a 400-token prompt in four llama.cpp contexts of the 1.5B target, in one call and in 32-row calls,
interleaved rounds: `python probe_prefill_configs.py <target gguf> 400 3`."""
import sys, time, statistics
import llama_cpp as L
path = sys.argv[1]; N = int(sys.argv[2]); R = int(sys.argv[3])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
def make(fa, tk, tv, nctx, ub=512):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = nctx, 2048, ub, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = getattr(L, f"GGML_TYPE_{tk}"), getattr(L, f"GGML_TYPE_{tv}")
    return L.llama_init_from_model(model, cp)
ctxs = {"side noFA Q8_0/F16": make(0, "Q8_0", "F16", 8192), "server FA F16/F16": make(1, "F16", "F16", 32768),
        "noFA F16/F16": make(0, "F16", "F16", 8192), "FA Q8_0/F16": make(1, "Q8_0", "F16", 8192)}
b = L.llama_batch_init(2048, 0, 1)
def prefill(ctx, chunk):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    t0 = time.perf_counter()
    for i in range(0, N, chunk):
        n = min(chunk, N - i)
        for j in range(n):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = (13 * (i + j)) % 30000, i + j, 1, i + j == N - 1
            b.seq_id[j][0] = 0
        b.n_tokens = n
        assert L.llama_decode(ctx, b) == 0
    return time.perf_counter() - t0
res = {}
for r in range(R):
    for k, c in ctxs.items():
        for chunk in (N, 32):
            res.setdefault((k, chunk), []).append(prefill(c, chunk))
base = statistics.median(res[("server FA F16/F16", N)])
for (k, chunk), v in res.items():
    print(f"N={N} {k} calls of {chunk}: median {statistics.median(v):.2f}s (÷ server one call {base/statistics.median(v):.2f}x) {['%.2f' % x for x in v]}", flush=True)
