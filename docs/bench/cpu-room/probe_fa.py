"""A prompt context with flash attention over F16 keys and values (llama-server's): do a prompt's cells and last logits keep
their bits across call splits (`bits`), and what it costs against the prompts' context (no flash attention, Q8_0/F16)
(`time ROUNDS`): `python probe_fa.py <gguf> N bits|time [ROUNDS]`."""
import sys, time, numpy as np, llama_cpp as L
from speculor.runtime import llama_fill as fill
path, N = sys.argv[1], int(sys.argv[2])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
def mk(fa, kt):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k, cp.type_v = kt, L.GGML_TYPE_F16
    return L.llama_init_from_model(model, cp)
ctx = mk(True, L.GGML_TYPE_F16)
toks = [(37 * i + 11) % 20000 for i in range(N)]
b = L.llama_batch_init(512, 0, 1)
def run(c, splits):
    L.llama_memory_clear(L.llama_get_memory(c), True)
    t = time.perf_counter()
    for s, e in zip(splits, splits[1:]):
        for k, i in enumerate(range(s, e)):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = toks[i], i, 1, i == e - 1
            b.seq_id[k][0] = 0
        b.n_tokens = e - s
        assert L.llama_decode(c, b) == 0
    dt = time.perf_counter() - t
    lg = np.ctypeslib.as_array(L.llama_get_logits_ith(c, e - s - 1), shape=(nv,)).copy()
    return fill.parse(fill.state_of(L, c, 0)), lg, dt
def grid(step, first=0):
    g = list(range(0, N, step)) + [N]
    return g
if sys.argv[3] == "bits":
    ref, rl, _ = run(ctx, [0, N])
    cases = {"512": [0, 512, N] if N > 512 else [0, N], "64grid+rest": [0, 64, 128, 192, N], "128+rest": [0, 128, N],
             "64,68,rest": [0, 64, 132, N], "off4 (0,66,..)": [0, 66, N], "off4 (0,130)": [0, 130, N], "64s,rest 64": [0,64,128,236,N],
             "neg: 32grid": grid(32), "neg: last<64": [0, N - 40, N]}
    for name, sp in cases.items():
        sp = sorted(set(x for x in sp if x <= N))
        st, lg, _ = run(ctx, sp)
        kd = sum(int((k0 != k1).any()) for (_, _, k0), (_, _, k1) in zip(ref.keys, st.keys))
        vd = sum(int((np.asarray(v0) != np.asarray(v1)).any()) for (_, _, v0), (_, _, v1) in zip(ref.values, st.values))
        print(f"N={N} {name:16s} calls={[b-a for a,b in zip(sp,sp[1:])][:6]} K tensors differ {kd}, V {vd}, last logits {'equal' if np.array_equal(lg, rl) else 'max|d| %.3g' % np.abs(lg-rl).max()}", flush=True)
else:
    ctx2 = mk(False, L.GGML_TYPE_Q8_0)
    res = {k: [] for k in ("FA F16/F16 one", "FA F16/F16 64s", "noFA Q8/F16 one")}
    for r in range(int(sys.argv[4])):
        res["FA F16/F16 one"].append(run(ctx, [0, 512, N] if N > 512 else [0, N])[2])
        res["noFA Q8/F16 one"].append(run(ctx2, [0, 512, N] if N > 512 else [0, N])[2])
        res["FA F16/F16 64s"].append(run(ctx, grid(64))[2])
    for k, v in res.items():
        print(f"N={N} {k}: median {np.median(v):.2f}s {['%.2f' % x for x in v]}", flush=True)
    st = run(ctx, [0, N])[0]
    import gguf.quants as q, gguf
    t = time.perf_counter()
    for kt, row, k in st.keys:
        f = k.view(np.float16).astype(np.float32)
        qq = q.quantize(f, gguf.GGMLQuantizationType.Q8_0)
    print(f"N={N} F16->Q8_0 keys via gguf: {time.perf_counter()-t:.3f}s", flush=True)
