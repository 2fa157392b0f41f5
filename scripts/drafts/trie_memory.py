"""The shared trie's memory (#38): SuffixCache at depth 24 over the embedded tokenizer's ids of 200 prompts
(code-edit, summarize, MT-Bench), indexed 16 tokens at a time as a server's outputs are, for two bounds.
Run: python scripts/drafts/trie_memory.py (tracemalloc counts Python's allocations: the trie is pure Python)."""

import time
import tracemalloc

from transformers import AutoTokenizer

from speculor.bench import prompts
from speculor.core.suffix import SuffixCache
from speculor.runtime import embedded

tok = AutoTokenizer.from_pretrained(str(embedded.model_dir("qwen2.5-coder-1.5b-instruct")))
ids = [tok(p.text)["input_ids"] for p in prompts.load(["code-edit", "summarize", "mtbench"], 200)]
for max_tokens in (16384, 65536):
    tracemalloc.start()
    cache, n, t0 = SuffixCache(24, max_tokens), 0, time.perf_counter()
    for seq in ids:
        s = cache.open()
        for i in range(0, len(seq), 16):
            cache.extend(s, seq[i : i + 16])
            n += len(seq[i : i + 16])
    seconds = time.perf_counter() - t0
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"max_tokens {max_tokens}: {cache.tokens} tokens kept of {n} indexed, {cache.trie.nodes} nodes, "
        f"{now / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB), {seconds / n * 1e6:.0f} us a token under tracemalloc"
    )
