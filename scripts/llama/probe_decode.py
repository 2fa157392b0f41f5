"""One-row decode steps after an N-token prompt in four llama.cpp contexts of the 1.5B target, interleaved step by step
(R rounds of 32 steps): `python probe_decode.py <target gguf> 400 4`."""

# one-row decode steps after an N-token prompt, three contexts of one model, interleaved rounds
import statistics
import sys
import time

import llama_cpp as L

path = sys.argv[1]
N = int(sys.argv[2])
R = int(sys.argv[3])
S = 32
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())


def make(fa, tk, tv, nctx, seqs):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = nctx, 512, 512, seqs
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = getattr(L, f"GGML_TYPE_{tk}"), getattr(L, f"GGML_TYPE_{tv}")
    if seqs > 1:
        cp.kv_unified = True
    return L.llama_init_from_model(model, cp)


configs = {
    "ours FA Q8_0/F16 16384 cells 64 seqs": (1, "Q8_0", "F16", 16384, 64),
    "llama-cpp-python noFA F16/F16": (0, "F16", "F16", N + 200, 1),
    "llama-server FA F16/F16 32768": (1, "F16", "F16", 32768, 1),
    "FA Q8_0/F16 small": (1, "Q8_0", "F16", N + 200, 1),
}
ctxs = {k: make(*v) for k, v in configs.items()}
b = L.llama_batch_init(512, 0, 1)


def prefill(ctx):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    for i in range(0, N, 512):
        n = min(512, N - i)
        for j in range(n):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = (13 * (i + j)) % 30000, i + j, 1, i + j == N - 1
            b.seq_id[j][0] = 0
        b.n_tokens = n
        assert L.llama_decode(ctx, b) == 0


res = {k: [] for k in ctxs}
for _r in range(R):
    for c in ctxs.values():
        prefill(c)
    for s in range(S):
        for k, ctx in ctxs.items():
            b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = (7 * s) % 30000, N + s, 1, True
            b.seq_id[0][0] = 0
            b.n_tokens = 1
            t0 = time.perf_counter()
            assert L.llama_decode(ctx, b) == 0
            L.llama_get_logits_ith(ctx, 0)
            res[k].append(time.perf_counter() - t0)
base = statistics.median(res["llama-cpp-python noFA F16/F16"])
for k, v in res.items():
    m = statistics.median(v)
    print(
        f"N={N} {k}: step ms median {1000 * m:.1f} (÷ llama-cpp-python {base / m:.3f}x) over {len(v)} steps", flush=True
    )
