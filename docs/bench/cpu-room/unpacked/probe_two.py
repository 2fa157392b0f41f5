"""Prefill on the repacked weights (side context, flash off), rows on the unpacked weights (shared memory, flash on):
prefill time, t(k) and bits of a k-row call against one-row calls. argv: path tiled(0/1)"""
import os, sys, time
if sys.argv[2] == "0":
    os.environ["GGML_CPU_TILED_MM"] = "0"
import numpy as np
import llama_cpp as L
from speculor.runtime import llama_fill as fill
path = sys.argv[1]
L.llama_backend_init()
def load(repack):
    mp = L.llama_model_default_params(); mp.use_extra_bufts = repack
    return L.llama_model_load_from_file(path.encode(), mp)
def context(model, fa, seqs):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 256, seqs
    cp.n_threads = cp.n_threads_batch = 2; cp.kv_unified = True
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = L.GGML_TYPE_Q8_0, L.GGML_TYPE_F16
    return L.llama_init_from_model(model, cp)
A, B = load(True), load(False)
side, ctx = context(A, False, 1), context(B, True, 4)
mem = L.llama_get_memory(ctx)
vocab = L.llama_model_get_vocab(A); V = L.llama_vocab_n_tokens(vocab)
def decode(c, rows):
    b = L.llama_batch_init(len(rows), 0, 4); b.n_tokens = len(rows)
    for i, (tok, pos, want) in enumerate(rows):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want); b.seq_id[i][0] = 0
    assert L.llama_decode(c, b) == 0
    out = {i: np.ctypeslib.as_array(L.llama_get_logits_ith(c, i), shape=(V,)).copy() for i, r in enumerate(rows) if r[2]}
    L.llama_batch_free(b); return out
text = (open("/work/main/README.md").read() * 3).encode()[:4000]
toks = (L.llama_token * 4096)(); n = L.llama_tokenize(vocab, text, len(text), toks, 4096, True, True)
prompt = list(toks[:768]); P = len(prompt)
ts = []
for r in range(3):
    L.llama_memory_clear(L.llama_get_memory(side), True)
    t0 = time.perf_counter()
    for i in range(0, P, 512):
        decode(side, [(t, i + p, i + p == P - 1) for p, t in enumerate(prompt[i:i + 512])])
    ts.append(time.perf_counter() - t0)
print(f"tiled={sys.argv[2]} prefill {P} tokens on repacked, flash off: {[round(t, 2) for t in ts]} s", flush=True)
s = fill.parse(fill.state_of(L, side, 0))
fill.set_state(L, ctx, fill.write(s, 0, trans=False), 0)
cont = [(100 + 37 * i) % 5000 for i in range(32)]
alone = [decode(ctx, [(cont[i], P + i, True)])[0] for i in range(32)]
L.llama_memory_seq_rm(mem, 0, P, -1)
diffs = {}
for k in (2, 3, 4, 5, 8, 9, 16, 32):
    got = decode(ctx, [(cont[i], P + i, True) for i in range(k)]); L.llama_memory_seq_rm(mem, 0, P, -1)
    diffs[k] = max(float(np.abs(got[i] - alone[i]).max()) for i in range(k))
times = {}
for k in (1, 2, 3, 4, 8, 16):
    t = []
    for _ in range(5):
        t0 = time.perf_counter(); decode(ctx, [(cont[i], P + i, True) for i in range(k)]); t.append(time.perf_counter() - t0)
        L.llama_memory_seq_rm(mem, 0, P, -1)
    times[k] = round(sorted(t)[2] * 1000, 1)
print(f"unpacked rows: max|k-row - alone| {diffs}\n  t(k) ms {times}", flush=True)
ctxA = context(A, True, 4); memA = L.llama_get_memory(ctxA)
fill.set_state(L, ctxA, fill.write(s, 0, trans=False), 0)
for rnd in range(2):
    tA, tB = {}, {}
    for k in (1, 2, 3, 4, 8, 16):
        for c, m, tt in ((ctxA, memA, tA), (ctx, mem, tB)):
            t = []
            for _ in range(5):
                t0 = time.perf_counter(); decode(c, [(cont[i], P + i, True) for i in range(k)]); t.append(time.perf_counter() - t0)
                L.llama_memory_seq_rm(m, 0, P, -1)
            tt[k] = round(sorted(t)[2] * 1000, 1)
    print(f"round {rnd}: repacked t(k) {tA}\n         unpacked t(k) {tB}", flush=True)
