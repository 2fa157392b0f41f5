"""The cells' bytes after a 100-token prompt filled in the prompts' context (no flash attention, Q8_0/F16, ubatch 512)
with its calls split in other ways, against the server's 32-row grid: `python probe_splits.py <gguf>`."""

import sys

import llama_cpp as L
import numpy as np

from speculor.runtime.llama import state

path = sys.argv[1]
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 512, 512, 1
cp.n_threads = cp.n_threads_batch = 2
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
cp.type_k, cp.type_v = L.GGML_TYPE_Q8_0, L.GGML_TYPE_F16
ctx = L.llama_init_from_model(model, cp)
toks = [(37 * i + 11) % 20000 for i in range(100)]
b = L.llama_batch_init(512, 0, 1)


def run(splits):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    for s, e in zip(splits, splits[1:], strict=False):
        for k, i in enumerate(range(s, e)):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = toks[i], i, 1, i == e - 1
            b.seq_id[k][0] = 0
        b.n_tokens = e - s
        assert L.llama_decode(ctx, b) == 0
    return state.parse(state.get_seq(L, ctx, 0))


ref = run([0, 32, 64, 96, 100])
for sp in (
    [0, 24, 32, 64, 96, 100],
    [0, 8, 32, 64, 96, 100],
    [0, 32, 44, 64, 96, 100],
    [0, 32, 64, 68, 96, 100],
    [0, 32, 64, 88, 96, 100],
    [0, 28, 32, 64, 96, 100],
    [0, 32, 64, 92, 96, 100],
    [0, 32, 64, 100],
    [0, 30, 32, 64, 96, 100],
):
    st = run(sp)
    bad = []
    for li, ((_, _, k0), (_, _, k1)) in enumerate(zip(ref.keys, st.keys, strict=False)):
        d = np.nonzero((k0 != k1).any(axis=1))[0]
        if len(d):
            bad.append(("K", li, int(d[0]), len(d)))
    for li, ((_, _, v0), (_, _, v1)) in enumerate(zip(ref.values, st.values, strict=False)):
        d = np.nonzero((np.asarray(v0) != np.asarray(v1)).reshape(100, -1).any(axis=1))[0]
        if len(d):
            bad.append(("V", li, int(d[0]), len(d)))
    print(
        sp,
        "equal" if not bad else f"differ: first {min(bad, key=lambda x: (x[1], x[2]))}, {len(bad)} tensors",
        flush=True,
    )
