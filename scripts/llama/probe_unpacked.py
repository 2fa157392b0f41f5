"""Do a row's bits depend on its call's size when the weights are not repacked? And what does a call cost then?

The target GGUF on llama.cpp as speculor's exact backend sets it up (flash attention, Q8_0 keys and F16 values, one
unified memory), once with llama.cpp's weight repacking (use_extra_bufts, the default) and once without, ggml's
tiled matmul off in both (GGML_CPU_TILED_MM=0; read once per process, so each setting runs in a process of its own).
After a PREFIX-token prompt, a chain of n rows (n = 1..16) is decoded in one call, its logits compared with the same
rows decoded one a call (max |diff|), and each size timed (median of REPS calls, kernel seconds).

    python probe_unpacked.py GGUF [PREFIX]        (runs both settings, each in a child process)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
REPS = 7


def child(path: str, repack: bool, prefix: int) -> None:
    from speculor.runtime.llama import KV_TYPES, N_BATCH, N_UBATCH, _lib

    L = _lib()  # llama.cpp initialized, its log silenced, as the backend does
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = repack
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, N_BATCH, N_UBATCH, 4
    cp.n_threads = cp.n_threads_batch = 2
    cp.kv_unified = True
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k, cp.type_v = (getattr(L, f"GGML_TYPE_{t}") for t in KV_TYPES)
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(N_BATCH, 0, 1)
    rng = np.random.default_rng(0)
    toks = rng.integers(100, 20000, prefix + 64).tolist()

    def decode(tokens, pos0, want_all=True):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = want_all or i == len(tokens) - 1
        t0 = time.perf_counter()
        assert L.llama_decode(ctx, batch) == 0
        dt = time.perf_counter() - t0
        rows = [
            np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
            for i in range(len(tokens))
            if want_all
        ]
        return rows, dt

    for start in range(0, prefix, N_UBATCH):  # the prompt, one ubatch a call
        decode(toks[start : min(prefix, start + N_UBATCH)], start, want_all=False)
    alone = []
    for i in range(max(SIZES)):  # the reference: one row a call
        rows, _ = decode([toks[prefix + i]], prefix + i)
        alone.append(rows[0])
    L.llama_memory_seq_rm(mem, 0, prefix, -1)
    t1 = None
    for n in SIZES:
        times, diff = [], 0.0
        for _ in range(REPS):
            rows, dt = decode(toks[prefix : prefix + n], prefix)
            L.llama_memory_seq_rm(mem, 0, prefix, -1)
            times.append(dt)
            diff = max(diff, max(float(np.abs(r - a).max()) for r, a in zip(rows, alone[:n], strict=True)))
        t = statistics.median(times)
        t1 = t1 or t
        print(
            f"repack={int(repack)} n={n:2d}  t(n) {t * 1e3:6.1f} ms  t(n)/t(1) {t / t1:5.2f}"
            f"  per row {t / t1 / n:4.2f}  max|row - alone| {diff:.3g}",
            flush=True,
        )


def main() -> None:
    if len(sys.argv) > 3:
        child(sys.argv[1], sys.argv[3] == "1", int(sys.argv[2]))
        return
    prefix = sys.argv[2] if len(sys.argv) > 2 else "400"
    env = dict(os.environ, GGML_CPU_TILED_MM="0")
    for repack in ("1", "0"):
        subprocess.run([sys.executable, __file__, sys.argv[1], prefix, repack], env=env, check=True)


if __name__ == "__main__":
    main()
