"""Do rows keep their bits across calls whose sizes are multiples of 4 (the repacked gemm's 4-row blocks)?
argv: path repack(0/1) [ENV=VALUE...]. Reference: rows decoded 4 a call (a chain), each call after the last."""

import os
import sys
import time

for kv in sys.argv[3:]:
    k, v = kv.split("=")
    os.environ[k] = v
import llama_cpp as L  # noqa: E402 (after the environment variables above, which ggml reads)
import numpy as np  # noqa: E402

path, repack = sys.argv[1], bool(int(sys.argv[2]))
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.use_extra_bufts = repack
model = L.llama_model_load_from_file(path.encode(), mp)
vocab = L.llama_model_get_vocab(model)
V = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 256, 8
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
    out = {
        i: np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy() for i, r in enumerate(rows) if r[2]
    }
    L.llama_batch_free(b)
    return out


text = open(os.path.join(os.path.dirname(__file__), "../../README.md")).read().encode()[:3000]  # any text
toks = (L.llama_token * 4096)()
n = L.llama_tokenize(vocab, text, len(text), toks, 4096, True, True)
prompt = list(toks[:n])
P = len(prompt)
for i in range(0, P, 256):
    decode([(t, i + p, False, 0) for p, t in enumerate(prompt[i : i + 256])])
cont = [(100 + 37 * i) % 5000 for i in range(16)]


def row(i, s=0):
    return (cont[i], P + i, True, s)


def reset():
    for s in range(1, 8):
        L.llama_memory_seq_rm(mem, s, -1, -1)
    L.llama_memory_seq_rm(mem, 0, P, -1)


ref = {}
for j in range(0, 16, 4):
    got = decode([row(i) for i in range(j, j + 4)])
    ref.update({j + k: v for k, v in got.items()})
reset()


def cmp(got, idx):
    return max(float(np.abs(got[k] - ref[i]).max()) for k, i in idx)


res = {}
for k in (8, 12, 16):
    got = decode([row(i) for i in range(k)])
    reset()
    res[f"chain{k}"] = cmp(got, [(i, i) for i in range(k)])
# one row + 3 pads on sequence 7 (positions 0..2), row by row: rows 0..3
worst = 0.0
for i in range(4):
    got = decode([row(i)] + [(cont[0], p, True, 7) for p in range(3)])
    L.llama_memory_seq_rm(mem, 7, -1, -1)
    worst = max(worst, float(np.abs(got[0] - ref[i]).max()))
reset()
res["1+3pads"] = worst
# two requests: seq 1 copies the prompt; rows 0..3 of seq 0 and of seq 1 in one 8-row call, interleaved
L.llama_memory_seq_cp(mem, 0, 1, 0, P)
rows = []
for i in range(4):
    rows += [row(i, 0), row(i, 1)]
got = decode(rows)
reset()
res["2req-interleaved8"] = max(float(np.abs(got[2 * i + s] - ref[i]).max()) for i in range(4) for s in (0, 1))
# the one-row class, for contrast
got = decode([row(0)])
reset()
res["1row"] = float(np.abs(got[0] - ref[0]).max())
times = {}
for k in (1, 2, 3, 4, 8, 12, 16):
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        decode([(cont[i], P + i, True, 0) for i in range(k)])
        ts.append(time.perf_counter() - t0)
        reset()
    times[k] = round(sorted(ts)[len(ts) // 2] * 1000, 1)
print(
    f"repack={repack} env={sys.argv[3:]} prompt={P}: max|row - its 4-a-call value| {res}\n"
    f"   t(k) ms median of 5 {times}",
    flush=True,
)
