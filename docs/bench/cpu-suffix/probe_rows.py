"""Bits of a row computed in a k-row chain call against the same row decoded one row a call, and t(k), on the
embedded target with speculor's memory (Q8_0 keys, F16 values, flash attention). argv: path repack(0/1) [env...]"""
import os, sys, time
for kv in sys.argv[3:]:
    k, v = kv.split("="); os.environ[k] = v
import numpy as np
import llama_cpp as L
path, repack = sys.argv[1], bool(int(sys.argv[2]))
L.llama_backend_init()
mp = L.llama_model_default_params(); mp.use_extra_bufts = repack
model = L.llama_model_load_from_file(path.encode(), mp)
vocab = L.llama_model_get_vocab(model); V = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 256, 4
cp.n_threads = cp.n_threads_batch = 2; cp.kv_unified = True; cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
cp.type_k, cp.type_v = L.GGML_TYPE_Q8_0, L.GGML_TYPE_F16
ctx = L.llama_init_from_model(model, cp); mem = L.llama_get_memory(ctx)
def decode(rows):
    b = L.llama_batch_init(len(rows), 0, 4); b.n_tokens = len(rows)
    for i, (tok, pos, want) in enumerate(rows):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want); b.seq_id[i][0] = 0
    assert L.llama_decode(ctx, b) == 0
    out = {i: np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy() for i, r in enumerate(rows) if r[2]}
    L.llama_batch_free(b); return out
text = open(sys.argv[0]).read().encode()[:3000]
toks = (L.llama_token * 4096)(); n = L.llama_tokenize(vocab, text, len(text), toks, 4096, True, True)
prompt = list(toks[:n]); P = len(prompt)
for i in range(0, P, 256):
    decode([(t, i + p, False) for p, t in enumerate(prompt[i:i + 256])])
cont = [(100 + 37 * i) % 5000 for i in range(16)]
alone = []
for i in range(16):
    alone.append(decode([(cont[i], P + i, True)])[0])
L.llama_memory_seq_rm(mem, 0, P, -1)
diffs = {}
for k in (2, 3, 4, 5, 7, 8, 9, 12, 16):
    got = decode([(cont[i], P + i, True) for i in range(k)]); L.llama_memory_seq_rm(mem, 0, P, -1)
    diffs[k] = max(float(np.abs(got[i] - alone[i]).max()) for i in range(k))
times = {}
for k in (1, 2, 3, 4, 6, 8, 12, 16):
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); decode([(cont[i], P + i, i == k - 1) for i in range(k)]); ts.append(time.perf_counter() - t0)
        L.llama_memory_seq_rm(mem, 0, P, -1)
    times[k] = round(sorted(ts)[len(ts) // 2] * 1000, 1)
print(f"repack={repack} env={sys.argv[3:]} prompt={P}: max|k-row call - alone| {diffs}\n   t(k) ms median of 5 {times}", flush=True)
