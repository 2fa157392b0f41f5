"""#36: the quality of our KV memory (Q8_0 keys, F16 values, flash attention) against llama.cpp's defaults (F16
keys and values, no flash attention), and where our greedy answers part from llama.cpp's.

1. Perplexity of the embedded target over held-out text (the last 40 HumanEval functions with their solutions and
   ShareGPT turns the bench does not use), the text in 512-token windows, every row's logits, in llama.cpp
   contexts of each memory.
2. Greedy answers (64 tokens, chat template) of MT-Bench and HumanEval prompts: llama-cpp-python's Llama with its
   defaults; the same with our memory; our engine's plain decoding; and our engine's plain decoding with the
   prompt prefilled as llama.cpp does (the whole prompt, last token included, in 512-row calls).
Run: .venv/bin/python scripts/llama/kv_quality.py (record: docs/bench/cpu-never-slower/kv_quality.txt)"""

import math

import llama_cpp as L
import numpy as np

from speculor import load_pair
from speculor.api import Speculor
from speculor.bench import prompts as P
from speculor.bench.prompts import sharegpt_records
from speculor.config import SamplingConfig
from speculor.runtime.backend import forward1
from speculor.runtime.llama import model as llama
from speculor.runtime.prepare import gguf_file

pair = load_pair(backend="llama.cpp", threads=2, draft=None)
sp = Speculor(pair, strategy="plain")
path = gguf_file(pair.target_name)
MEMORIES = {
    "llama.cpp default (F16/F16, no flash attention)": dict(),
    "speculor (Q8_0 keys / F16 values, flash attention)": dict(
        flash_attn=True, type_k=L.GGML_TYPE_Q8_0, type_v=L.GGML_TYPE_F16
    ),
    "Q8_0 / Q8_0, flash attention (speculor before #36)": dict(
        flash_attn=True, type_k=L.GGML_TYPE_Q8_0, type_v=L.GGML_TYPE_Q8_0
    ),
}

# 1. perplexity over held-out text
solutions = [p.text for p in P.LOADERS["code-edit"]()[-40:]]  # HumanEval functions with their solutions
chats = [
    c["value"]
    for r in list(sharegpt_records(3000))[-400:]
    for c in r.get("conversations", [])[:1]
    if len(c["value"]) > 1500
][:12]
text_ids = [sp.pair.tokenizer.encode(t)[:1537] for t in ("\n\n".join(solutions), "\n\n".join(chats))]  # 3 windows each
print("held-out text tokens:", [len(t) for t in text_ids])


def nll(llm, ids):
    total, n = 0.0, 0
    for j in range(0, len(ids) - 1, 512):
        window = ids[j : j + 513]
        llm.reset()
        llm.eval(window[:-1])
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        total += float((lse - logits[np.arange(len(window) - 1), window[1:]]).sum())
        n += len(window) - 1
    return total / n


for name, kw in MEMORIES.items():
    llm = L.Llama(
        model_path=str(path), n_threads=2, n_threads_batch=2, n_ctx=1024, logits_all=True, verbose=False, **kw
    )
    per = [nll(llm, t) for t in text_ids]
    print(f"perplexity, {name}: code {math.exp(per[0]):.4f}, chat {math.exp(per[1]):.4f}")
    llm.close()

# 2. greedy answers
ps = P.load(["mtbench", "humaneval"], 8)
enc = [sp.encode(p.text, chat=p.chat) for p in ps]
cfg = SamplingConfig(max_new_tokens=64)
answers = {}
for name, kw in MEMORIES.items():
    llm = L.Llama(model_path=str(path), n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False, **kw)
    out = []
    for ids in enc:
        toks = []
        for t in llm.generate(ids, reset=True, temp=0.0, top_k=1, repeat_penalty=1.0):
            if t in sp.eos_ids or len(toks) == 64:
                break
            toks.append(t)
        out.append(toks)
    answers["llama-cpp-python, " + name] = out
    llm.close()
answers["speculor plain"] = [[t.id for t in sp.tokens(ids, cfg)] for ids in enc]


def prefilled_as_llama_cpp(ids):
    """Our backend's calls, the prompt prefilled as llama-cpp-python does: whole (its last token included), in
    512-row ubatches; then one row a call, greedy."""
    c, toks = m512.new_cache(), []
    logits = forward1(m512, c, ids, last=True)[-1]
    c.keep(list(range(len(ids))))
    while len(toks) < 64 and (t := int(logits.argmax())) not in sp.eos_ids:
        toks.append(t)
        logits = forward1(m512, c, [t])[-1]
        c.keep([0])
    return toks


llama.N_UBATCH = 512
m512 = llama.LlamaModel(path, threads=2)
llama.N_UBATCH = 256


answers["speculor backend, prompt prefilled as llama.cpp does"] = [prefilled_as_llama_cpp(ids) for ids in enc]
ref = answers["llama-cpp-python, llama.cpp default (F16/F16, no flash attention)"]
ours = answers["speculor plain"]
for name, out in answers.items():
    same_ref = sum(a == b for a, b in zip(out, ref, strict=False))
    same_ours = sum(a == b for a, b in zip(out, ours, strict=False))
    print(
        f"{name}: equal to llama.cpp's default answer {same_ref}/{len(ref)}, to speculor's plain {same_ours}/{len(ref)}"
    )
