"""The llama.cpp backend (runtime/llama/) on the embedded GGUF pair: a tree verified in one forward equals each
path decoded alone, bit for bit; compaction keeps exactly the accepted path; rows packed with other requests' rows
equal the same rows alone; speculative decoding equals this backend's plain decoding at T = 0 and has its
distribution under sampling (chi-square through the engine); negative controls for the KV types and the sampler
(the kernels' own: tests/test_llama_bits.py)."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.llama_rows import PARENTS, PATHS, PREFIX, PROMPT, TREE, alone, prefilled

from speculor import SamplingConfig, Speculor, engine
from speculor.engine import batch as batched_engine
from speculor.errors import SpeculorError
from speculor.runtime import openmp
from speculor.runtime.backend import Block, Rows, forward1
from speculor.runtime.llama import calls as packing
from speculor.runtime.llama import cells, state
from speculor.runtime.llama import model as llama

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def llama_pair():
    from speculor import load_pair

    return load_pair(backend="llama.cpp", threads=2)


@pytest.fixture(scope="module")
def draft(llama_pair):
    """The 0.5B GGUF: the cheaper model for the tests of the backend's own mechanics."""
    return llama_pair.draft


def tree_logits(model):
    cache = prefilled(model, PROMPT[:-1])
    return cache, forward1(model, cache, [PROMPT[-1]] + TREE, torch.tensor(PARENTS)).logits


def test_tree_in_one_forward_equals_each_path_alone(draft):
    _, logits = tree_logits(draft)
    assert torch.equal(logits[0], alone(draft, PROMPT))
    for row, path in PATHS.items():
        assert torch.equal(logits[row], alone(draft, PROMPT + path)), path


def test_calls_are_timed_by_their_rows(draft):
    """runtime/call_times.CallTimes: each exact call's seconds under its rows; a prompt's calls (of TILED rows or
    more, in its own context) are not a tree's and are not counted."""
    calls, before = draft.call_times, list(draft.call_times.n)
    prefilled(draft, (PROMPT * 4)[:40])
    assert calls.n == before
    cache = prefilled(draft, PROMPT[:-1])  # a short prompt: a call of 10 rows like a tree's
    before[len(PROMPT) - 1] += 1
    assert calls.n == before, (calls.n, before)
    forward1(draft, cache, [PROMPT[-1]] + TREE, torch.tensor(PARENTS))  # 6 rows: one call
    alone(draft, PROMPT + [100, 300])  # its 10-token prompt, then three one-row calls
    want = list(before)
    want[1], want[6], want[len(PROMPT) - 1] = before[1] + 3, before[6] + 1, before[len(PROMPT) - 1] + 1
    assert calls.n == want and calls.s[1] > 0 and calls.s[6] > 0


def test_a_thread_that_decoded_ends_its_openmp_team(draft):
    """runtime/openmp.py: after release() the calling thread's team is gone (a thread fewer: its 2-thread team's
    worker) and decoding makes it again with the same bits."""
    before = alone(draft, PROMPT)  # this thread decodes: its team is made
    tasks = len(os.listdir("/proc/self/task"))
    assert openmp.release(), "llama.cpp's kernels here run on libgomp (OpenMP)"
    assert len(os.listdir("/proc/self/task")) < tasks
    assert torch.equal(alone(draft, PROMPT), before)


def long_rows_alone(model) -> list[bool]:
    """Per path of TREE after a 700-token context: whether its row in one tree forward equals the row alone."""
    long = (PROMPT * 60)[:700]
    cache = prefilled(model, long[:-1])
    logits = forward1(model, cache, [long[-1]] + TREE, torch.tensor(PARENTS)).logits
    return [torch.equal(logits[row], alone(model, long + path, prefix=len(long) - 1)) for row, path in PATHS.items()]


def test_rows_equal_alone_over_a_long_context(draft):
    """Over >= 512 cells llama.cpp splits a one-row call's attention across threads when keys and values have one
    type; with the backend's Q8_0 keys and F16 values a row of a tree still gets the one-row bits."""
    assert all(long_rows_alone(draft))


def test_keys_and_values_of_one_type_differ_over_a_long_context(llama_pair, monkeypatch):
    """Negative control: F16 keys and values (llama.cpp's default) give a tree's rows other bits than rows alone."""
    monkeypatch.setattr(llama, "KV_TYPES", ("F16", "F16"))
    f16 = llama.LlamaModel(llama_pair.draft.path, threads=2)
    assert not all(long_rows_alone(f16))


def test_hidden_states_leave_the_logits_unchanged(draft):
    """The target's features (llama.cpp's embeddings output, switched on for the forward that asks) come with the
    same logits bits; they are the final-norm states the output matrix reads (logits = W h up to its rounding)."""
    _, plain = tree_logits(draft)
    cache = prefilled(draft, PROMPT[:-1])
    out = forward1(draft, cache, [PROMPT[-1]] + TREE, torch.tensor(PARENTS), hidden=True)
    logits, hidden = out.logits, out.hidden
    assert torch.equal(logits, plain)
    assert hidden.shape == (len(TREE) + 1, draft.hidden_size)
    _, again = tree_logits(draft)  # and switched off again
    assert torch.equal(again, plain)
    from speculor.runtime.gguf_rows import GGUFRows

    rows = GGUFRows(draft.path, ["output.weight", "token_embd.weight"])(torch.arange(2000))
    assert (hidden @ rows.T - logits[:, :2000]).abs().max() < 0.05 * logits[:, :2000].abs().max()


def test_a_tree_grown_by_depth_equals_the_tree_at_once(draft):
    _, whole = tree_logits(draft)
    cache = prefilled(draft, PROMPT[:-1])
    first = forward1(draft, cache, [PROMPT[-1]]).logits
    second = draft.forward([Block(cache, TREE[:2], torch.tensor([0, 0]), append=True)])[0].logits
    third = draft.forward([Block(cache, TREE[2:], torch.tensor([1, 1, 2]), append=True)])[0].logits
    assert torch.equal(torch.cat([first, second, third]), whole)


@pytest.mark.parametrize("kept", [[0, 1, 4], [0, 2, 5], [0, 1], [0]])
def test_compaction_keeps_exactly_the_accepted_path(draft, kept):
    cache, _ = tree_logits(draft)
    free = len(draft.cell_state.free_ids)
    cache.keep(kept)
    accepted = [([PROMPT[-1]] + TREE)[r] for r in kept]
    assert cache.length == len(PROMPT) - 1 + len(kept) and len(cache.pending) == 0
    assert len(draft.cell_state.free_ids) >= free  # the other paths' ids are back
    assert draft.memory.seq_pos_max(cache.base) == cache.length - 1
    nxt = forward1(draft, cache, [7]).logits[0]
    assert torch.equal(nxt, alone(draft, PROMPT[:-1] + accepted + [7]))


def test_rows_beside_other_requests_equal_the_rows_alone(draft):
    a, b = prefilled(draft, PROMPT[:-1]), prefilled(draft, PROMPT[3:-1])
    ra, rb = draft.forward([Block(a, [PROMPT[-1], 100]), Block(b, [PROMPT[-1], 200, 300], torch.tensor([-1, 0, 0]))])
    assert torch.equal(ra.logits[1], alone(draft, PROMPT + [100]))
    assert torch.equal(rb.logits[2], alone(draft, PROMPT[3:] + [300], prefix=PREFIX - 3))


def test_tree_blocks_fill_every_call_and_keep_their_rows_alone(draft, monkeypatch):
    """In calls of 3 rows at most (calls="vector"'s limit), blocks of 1, 3, 1 and 3 rows take 3 calls, not 4: a block
    continues in the next call where the last one has room left (ancestors first), and every row keeps its one-row
    bits."""
    monkeypatch.setitem(llama.CALLS, "exact", (llama.EXACT_ROWS, llama.N_BATCH))
    caches = [prefilled(draft, PROMPT[k:-1]) for k in range(4)]
    decode, calls = draft.decode, []
    monkeypatch.setattr(draft, "decode", lambda call, *a: (calls.append(sum(len(r) for _, r, _ in call)),
                                                            decode(call, *a))[1])
    out = draft.forward([Block(caches[0], [PROMPT[-1]]),
                         Block(caches[1], [PROMPT[-1], 200, 300], torch.tensor([-1, 0, 0])),
                         Block(caches[2], [PROMPT[-1]]),
                         Block(caches[3], [PROMPT[-1], 100, 400], torch.tensor([-1, 0, 1]))])
    assert calls == [3, 3, 2]
    assert torch.equal(out[1].logits[2], alone(draft, PROMPT[1:] + [300], prefix=PREFIX - 1))
    assert torch.equal(out[2].logits[0], alone(draft, PROMPT[2:], prefix=PREFIX - 2))
    assert torch.equal(out[3].logits[2], alone(draft, PROMPT[3:] + [100, 400], prefix=PREFIX - 3))


def test_trim_of_a_chain_keeps_its_first_rows(draft):
    cache = prefilled(draft, PROMPT[:-1])
    forward1(draft, cache, [PROMPT[-1], 100, 200])
    cache.trim(len(PROMPT) + 1)  # the root and 100 stay pending
    cache.keep([0, 1])
    assert torch.equal(forward1(draft, cache, [9]).logits[0], alone(draft, PROMPT + [100, 9]))


@pytest.fixture(scope="module")
def sp(llama_pair):
    return Speculor(llama_pair, strategy="plain")


CASES = ["Write a Python function that returns the n-th Fibonacci number.",
         "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden."]


@pytest.mark.parametrize("strategy, options", [("chain", {"k": 2}), ("ngram", {"budget": "k", "k": 4}),
                                               ("dyspec", {"budget": 4}), ("dyspec", {"budget": "auto"}),
                                               ("eagle", {"budget": 3}), ("specinfer", {"drafters": "boosted"})])
def test_speculative_equals_plain_at_t0(sp, strategy, options):
    cfg = SamplingConfig(max_new_tokens=40)
    for text in CASES:
        ids = sp.encode(text, chat=True)
        plain = sp.generate(ids, cfg, strategy="plain").token_ids
        assert sp.generate(ids, cfg, strategy=strategy, **options).token_ids == plain, (strategy, text)


def test_batched_equals_alone(sp):
    prompts = [sp.encode(t, chat=True) for t in CASES + ["Name three prime numbers."]]
    cfgs = [SamplingConfig(max_new_tokens=24), SamplingConfig(max_new_tokens=24, temperature=0.8, seed=3),
            SamplingConfig(max_new_tokens=24, temperature=0.8, seed=5)]
    strategy = sp.strategy_for("chain", k=2)
    alone_ids = [sp.generate(p, c, strategy="chain", k=2).token_ids for p, c in zip(prompts, cfgs, strict=True)]
    got: list[list[int]] = [[] for _ in prompts]
    entries = [(strategy.drafter(), p, c) for p, c in zip(prompts, cfgs, strict=True)]
    for i, toks in batched_engine.generate(sp.pair.target, entries, sp.eos_ids):
        got[i].extend(t.id for t in toks)
    assert got == alone_ids


def test_sampling_is_the_targets_law(sp, llama_pair):
    """The first token of chain:k=2 at T = 1.5, top-k 6, over 240 seeds: chi-square against the target's own law on
    this backend (p > 1e-3); the draft's law is rejected (the test can fail)."""
    from scipy.stats import chisquare

    ids = sp.encode("Pick a random word:", chat=False)
    cfg = dict(max_new_tokens=1, temperature=1.5, top_k=6, stop_on_eos=False)
    law = {}
    top = None
    for name, model in (("target", llama_pair.target), ("draft", llama_pair.draft)):
        logits = forward1(model, model.new_cache(), ids, last=True).logits[-1] / 1.5
        top = torch.topk(logits, 6).indices if top is None else top  # the target's six tokens, both laws on them
        law[name] = dict(zip(top.tolist(), torch.softmax(logits[top], -1).tolist(), strict=True))
    counts = dict.fromkeys(law["target"], 0)
    for seed in range(240):
        tok = sp.generate(ids, SamplingConfig(seed=seed, **cfg), strategy="chain", k=2).token_ids[0]
        assert tok in counts
        counts[tok] += 1
    obs = [counts[t] for t in law["target"]]

    def expected(p: list[float]) -> list[float]:  # float64, summing to the observed count as chisquare asks
        return [240 * x / math.fsum(p) for x in p]

    assert chisquare(obs, expected(list(law["target"].values()))).pvalue > 1e-3
    assert chisquare(obs, expected([law["draft"][t] for t in law["target"]])).pvalue < 1e-3


def test_a_corrupt_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(SpeculorError, match="could not read"):
        llama.LlamaModel(bad, threads=1)


def test_the_torch_only_options_are_refused_on_llama_cpp():
    from speculor import load_pair

    with pytest.raises(SpeculorError, match="--draft-vocab"):
        load_pair(backend="llama.cpp", draft_vocab=1024)
    with pytest.raises(SpeculorError, match="GGUF"):
        from speculor.runtime.prepare import gguf_file

        gguf_file("/nonexistent/folder")


def test_boost_tuning_runs_on_llama_cpp_features(llama_pair, tmp_path):
    """The pipeline at a tiny scale on this backend: its features, its greedy answers, a draft compared by depth."""
    from speculor.methods import boost_tune as bt
    from speculor.methods.boost_data import BackendSource
    from speculor.runtime.eagle_head import EagleConfig, load_pool

    tok = llama_pair.tokenizer
    chat = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for q in ("Name a prime number.", "What is 2 + 3?", "List the days of the week, one per line.")]
    data = {"train": [(p + [40, 41, 42, 43, 44, 45, 46], [False] * (len(p) - 1) + [True] * 7 + [False])
                      for p in chat[:2]], "selfgen": chat[:1], "heldout": {"chat": chat[2:]},
            "eos": sorted(llama_pair.target.eos_ids), "ids": list(range(256))}
    source = BackendSource(llama_pair.target)
    plan = bt.Plan(EagleConfig(source.hidden_size, width=16, ffn=16, blocks=1, vocab=256),
                   bt.TrainConfig(steps=4, batch=16, warmup=1), ssms=2)
    manifest = bt.run(source, data, plan, tmp_path / "pool", answer_tokens=12, selfgen_tokens=8,
                      draft=llama_pair.draft, dtype=torch.float32)
    row = manifest["heldout"]["chat"]
    assert set(row) >= {"ssm1", "ssm2", "pool", "draft"} and row["positions"] > 0
    assert row["draft"]["acceptance"][0] > 0.3  # the 0.5B draft agrees with its target often
    heads, _ = load_pool(tmp_path / "pool")
    assert heads[0].cfg.hidden_size == llama_pair.target.hidden_size
    again = bt.evaluate_pool(source, data, heads, answer_tokens=12, draft=llama_pair.draft)  # --evaluate
    assert again["chat"]["draft"] == row["draft"] and again["chat"]["positions"] == row["positions"]


def decoded(model, prompt, n, beside=None):
    """The logits of n greedy one-token steps after prompt on a fresh context of `model`'s file (n_ctx 1024); with
    `beside`, a request of 200 tokens stays live all along and one of 500 tokens is prefilled and forgotten
    first, so that the memory fills while this request decodes."""
    ctx = llama.LlamaModel(model.path, threads=2, n_ctx=1024)
    others = []
    if beside:
        others.append(prefilled(ctx, beside[:200]))
        gone = prefilled(ctx, beside[:500])
        del gone
    cache = prefilled(ctx, prompt[:-1])
    out, tok = [], prompt[-1]
    for _ in range(n):
        logits = forward1(ctx, cache, [tok]).logits[0]
        cache.keep([0])
        out.append(logits)
        tok = int(logits.argmax())
    return out


def steps_equal_alone(model) -> list[bool]:
    """Per step of a 300-token request decoding 60 tokens beside 200 live and 500 forgotten cells that fill a
    1024-cell memory while it decodes: whether its logits equal the step decoded alone."""
    prompt = (PROMPT * 40)[:300]
    alone_steps = decoded(model, prompt, 60)
    loaded = decoded(model, prompt, 60, beside=list(range(1000, 1600)))
    return [torch.equal(a, b) for a, b in zip(alone_steps, loaded, strict=True)]


def test_a_request_keeps_its_bits_when_the_memory_fills(draft):
    """Regression (#37): freeing the forgotten cells put the request's next rows below its older ones (attention
    sums in cell order), and its logits changed; the memory is compacted instead, in position order, bits copied."""
    assert all(steps_equal_alone(draft))


def test_freeing_the_graveyard_in_place_changes_the_bits(draft, monkeypatch):
    """Negative control: without compaction (the graveyard freed where it lies once the memory is full) the same
    request gets other logits once the memory has filled."""
    monkeypatch.setattr(cells.Cells, "compact_if_due", lambda self, blocks: None)
    same = steps_equal_alone(draft)
    assert all(same[:20]) and not all(same)


def test_a_request_keeps_its_bits_across_a_compaction_of_forgotten_cells(draft):
    """A memory whose forgotten cells outnumber its kept ones is compacted (runtime/llama/cells.py: every call would
    visit them) while it has room: a request decoding while another's 1100 cells are forgotten keeps the bits of
    its steps alone, and the memory shrinks to the cells still kept."""
    prompt = (PROMPT * 40)[:300]
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=4096)
    live = prefilled(ctx, list(range(1000, 1200)))
    cache = prefilled(ctx, prompt[:-1])
    gone = prefilled(ctx, list(range(2000, 3100)))
    del gone
    out, tok = [], prompt[-1]
    for _ in range(8):
        out.append(forward1(ctx, cache, [tok]).logits[0])
        cache.keep([0])
        tok = int(out[-1].argmax())
    assert ctx.cell_state.used == live.length + cache.length < 600
    assert all(torch.equal(a, b) for a, b in zip(out, decoded(draft, prompt, 8), strict=True))


def filled(ctx, tokens, chunk=32):
    """A cache holding `tokens`, filled in chunks as the server fills a prompt: the prompt memory's cells first,
    then calls up to each multiple of `chunk` (engine/batch.py `_chunk`); how many cells the memory lent, and the
    last row's logits (the memory's where it lent them all)."""
    cache = ctx.new_cache()
    lent, ready = ctx.reuse(cache, tokens, chunk)
    j = lent
    while j < len(tokens):
        grid = (j // chunk + 1) * chunk
        part = tokens[j:grid if len(tokens) - grid >= ctx.traits.min_chunk else len(tokens)]
        ready = Rows(forward1(ctx, cache, part, last=True).logits[-1:])
        cache.keep(list(range(len(part))))
        j += len(part)
    ctx.remember(cache, tokens, chunk, ready)
    return cache, lent, ready.logits[0]


def steps_after(ctx, cache, root, n=6):
    out, tok = [], root
    for _ in range(n):
        out.append(forward1(ctx, cache, [tok]).logits[0])
        cache.keep([0])
        tok = int(out[-1].argmax())
    return out


def test_a_prompt_lent_by_the_memory_gives_the_bits_it_would_compute(draft, monkeypatch):
    """The prompt memory lends a later prompt the cells of the whole chunks it shares with a kept one, and within
    the next chunk a multiple of 4 rows that leaves the chunk's rest a call of TILED (32) rows or more: none of a
    32-row chunk (70 shared: 64; 30 shared: 0), never its last 32 rows (100 shared of 101: 68) but to the same
    prompt, which takes all 100 and its last row's logits; the last row's logits and the request's next steps have
    the bits of a fresh context's.
    Negative control: with TILED 4, 28 of 30 lent, the chunk's last 4 rows a short call, and the steps differ."""
    first = (PROMPT * 12)[:101]
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)
    filled(ctx, first[:-1])
    partly = first[:30] + list(range(3000, 3071))
    cases = ((first, 100), (first + [3000], 68), (first[:70] + list(range(3000, 3031)), 64), (partly, 0),
             (list(range(500, 600)), 0))
    for prompt, lends in cases:
        fresh = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)
        cache, lent, last = filled(ctx, prompt[:-1])
        assert lent == lends
        fresh_cache, _, fresh_last = filled(fresh, prompt[:-1])
        want = steps_after(fresh, fresh_cache, prompt[-1])
        assert torch.equal(last, fresh_last)
        assert all(torch.equal(a, b) for a, b in zip(steps_after(ctx, cache, prompt[-1]), want, strict=True))
        if prompt is partly:
            uncapped = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)
            filled(uncapped, first[:-1])
            monkeypatch.setattr(packing, "TILED", 4)
            cache, lent, _ = filled(uncapped, prompt[:-1])
            monkeypatch.undo()
            assert lent == 28
            assert not all(torch.equal(a, b) for a, b in zip(steps_after(uncapped, cache, prompt[-1]), want,
                                                             strict=True))


def first_steps(ctx, req):
    """The root's logits from the prompt's last call (`root_in_prompt`), then the steps after their argmax."""
    first = req.root_result.logits[0]
    return [first, *steps_after(ctx, req.cache, int(first.argmax()))]


@pytest.mark.parametrize("n", [100, 103, 132])
def test_a_prompt_filled_in_chunks_equals_the_prompt_filled_at_once(draft, monkeypatch, n):
    """The server's chunks (engine/batch.py: 32 rows on a grid a step, or while none decodes up to fill_rows) and
    the library's prefill (one block, calls of 512) give a prompt the same cells and its last row, the root, the
    same logits, also where its last chunk would be short (100, 103, 132 rows: 4, 7, 4 left) and after a prompt
    memory lent its start (64 cells, the rest in one call): the root's logits and the request's next steps are
    bit-equal. Negative control: a short last chunk (min_chunk 1) differs."""
    prompt, cfg = (PROMPT * 12)[:n], SamplingConfig(max_new_tokens=4)
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)
    assert ctx.traits.root_in_prompt

    def chunked(p):  # the step that fills the last chunk (or the first, where the memory lent it all at admission)
        # draws the first token at once: its logits seen there
        a = batched_engine.Active(engine.start(ctx, None, p, cfg, prefill=False), frozenset())
        seen, settle = [], batched_engine.settle
        monkeypatch.setattr(batched_engine, "settle", lambda req, *x: seen.append(req.root_result) or settle(req, *x))
        while not seen:
            batched_engine.step(ctx, [a])
        monkeypatch.setattr(batched_engine, "settle", settle)
        return [seen[0].logits[0], *steps_after(ctx, a.req.cache, a.req.seq[-1])]

    def equal(got, want):
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    want = first_steps(ctx, engine.start(ctx, None, prompt, cfg))
    for rows in (llama.N_BATCH, 0):  # the whole prompt in one step, or a chunk a step
        monkeypatch.setattr(ctx, "traits", replace(ctx.traits, fill_rows=rows))
        ctx.prompts.clear()
        assert equal(chunked(prompt), want)
    other = prompt[:70] + list(range(3000, 3000 + n - 70))  # its first 64 cells lent by the prompt memory
    lent, reuse = [], ctx.reuse
    monkeypatch.setattr(ctx, "reuse", lambda *a: lent.append(reuse(*a)) or lent[-1])
    monkeypatch.setattr(ctx, "traits", replace(ctx.traits, fill_rows=llama.N_BATCH))
    assert equal(chunked(other), first_steps(ctx, engine.start(ctx, None, other, cfg)))
    assert equal(chunked(prompt), want)  # the same prompt again: all its cells and its root's logits lent
    assert [k for k, _ in lent] == [64, n] and lent[0][1] is None and lent[1][1] is not None
    monkeypatch.setattr(ctx, "traits", replace(ctx.traits, fill_rows=0))
    monkeypatch.setattr(ctx, "traits", replace(ctx.traits, min_chunk=1))
    ctx.prompts.clear()
    assert not equal(chunked(prompt), want)


def without_flash_attention(model, prompt):
    """llama.cpp's own context over the model's weights and KV types, flash attention off: the logits of the
    prompt's last row (filled in calls of N_BATCH rows) and of the step after it on the prompt's argmax."""
    L = model.lib
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, llama.N_BATCH, llama.N_BATCH, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type, (cp.type_k, cp.type_v) = L.LLAMA_FLASH_ATTN_TYPE_DISABLED, model.kv
    ctx, b, out = L.llama_init_from_model(model.model, cp), L.llama_batch_init(llama.N_BATCH, 0, 1), []
    for part in [*(range(i, min(i + llama.N_BATCH, len(prompt))) for i in range(0, len(prompt), llama.N_BATCH)),
                 [len(prompt)]]:
        for k, i in enumerate(part):
            tok = prompt[i] if i < len(prompt) else int(out[-1].argmax())
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k], b.seq_id[k][0] = tok, i, 1, i == part[-1], 0
        b.n_tokens = len(part)
        assert L.llama_decode(ctx, b) == 0
        out.append(torch.from_numpy(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(part) - 1),
                                                          shape=(model.n_vocab,)).copy())[:model.vocab_size])
    L.llama_batch_free(b)
    L.llama_free(ctx)
    return out[-2:]


def step_after_prompt(model, prompt):
    cache = model.new_cache()
    first = forward1(model, cache, prompt, last=True).logits[-1]
    cache.keep(list(range(len(prompt))))
    return first, forward1(model, cache, [int(first.argmax())]).logits[0]


def test_a_prompt_is_filled_as_llama_cpp_fills_it_without_flash_attention(draft, monkeypatch):
    """A prompt block is computed in the prompts' context (runtime/llama/fill.py): its last row has the bits of
    llama.cpp's own context without flash attention, and the next step, with flash attention over the cells copied
    into the shared memory, differs from that context's by rounding alone. Negative control: values copied
    without their transposition are another model's."""
    prompt = (PROMPT * 60)[:600]
    first, after = without_flash_attention(draft, prompt)
    ours = step_after_prompt(llama.LlamaModel(draft.path, threads=2, n_ctx=2048), prompt)
    assert torch.equal(ours[0], first)
    near = float((ours[1] - after).abs().max())
    read = state.parse
    monkeypatch.setattr(state, "parse", lambda buf: untransposed(read(buf)))
    far = float((step_after_prompt(llama.LlamaModel(draft.path, threads=2, n_ctx=2048), prompt)[1] - after)
                .abs().max())
    assert near < 1.0 < 5.0 < far, (near, far)


def untransposed(s):
    """The values' bytes read as if their layout were the other one."""
    s.values = [(vt, el, np.ascontiguousarray(v).reshape(v.shape[1], v.shape[0], el).transpose(1, 0, 2))
                for vt, el, v in s.values]
    return s


def test_a_prompt_keeps_its_bits_when_another_prompt_is_filled_between_its_chunks(draft):
    """The prompts' context holds one request's cells at a time: a prompt whose chunks alternate with another
    request's has its cells copied back in before its next chunk, and its steps keep the bits of the same chunks
    filled in a row."""
    p, q = (PROMPT * 20)[:200], list(range(3000, 3100))
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)

    def chunk(cache, tokens):
        forward1(ctx, cache, tokens)
        cache.keep(list(range(len(tokens))))

    a, b, c = ctx.new_cache(), ctx.new_cache(), ctx.new_cache()
    chunk(a, p[:100])
    chunk(a, p[100:199])
    chunk(b, p[:100])
    chunk(c, q)
    chunk(b, p[100:199])
    assert all(torch.equal(x, y) for x, y in zip(steps_after(ctx, b, p[-1]), steps_after(ctx, a, p[-1]), strict=True))


def test_a_prompt_after_a_rewound_cache_is_copied_in_again(draft):
    """A cache cut below the cells the prompts' context holds, and regrown to the same length by other tokens, has
    its cells copied in again before its next prompt block: its steps equal those of a cache that took the copy."""
    p, x = (PROMPT * 20)[:200], [7, 8]
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)

    def chunk(cache, tokens):
        forward1(ctx, cache, tokens)
        cache.keep(list(range(len(tokens))))

    steps = []
    for other in (False, True):
        cache = ctx.new_cache()
        chunk(cache, p[:100])
        cache.trim(98)
        chunk(cache, x)  # two rows: the shared memory's own calls
        if other:  # another prompt in the prompts' context: the cache is copied in, whatever it remembered
            chunk(ctx.new_cache(), list(range(3000, 3050)))
        chunk(cache, p[100:199])
        steps.append(steps_after(ctx, cache, p[-1]))
    assert all(torch.equal(a, b) for a, b in zip(*steps, strict=True))


def test_the_prompt_memory_keeps_no_cell_in_the_shared_memory(draft):
    """Kept prompts are bytes on the host: once their request ends no sequence holds a cell (every call would visit
    them); the prompt is copied in for the next request that starts with it (all of it for the same prompt)."""
    ctx = llama.LlamaModel(draft.path, threads=2, n_ctx=2048)
    prompt = (PROMPT * 12)[:100]
    cache, _, _ = filled(ctx, prompt)
    del cache
    ctx.cell_state.release()
    assert all(ctx.memory.seq_pos_max(s) < 0 for s in range(cells.MAX_SEQ))
    cache, lent, _ = filled(ctx, prompt)
    assert lent == 100 and ctx.memory.seq_pos_max(cache.base) == 99


def test_each_call_class_packs_a_tree_in_its_calls(draft, monkeypatch):
    """calls='exact' and 'batched' run a 6-row tree in one call, 'vector' in two; a bad value, or the setting on
    torch, is refused."""
    counted = []
    for calls in ("vector", "exact", "batched"):
        model = llama.LlamaModel(draft.path, threads=2, n_ctx=1024, calls=calls)
        decode = model.decode
        n = [0]

        def one(*args, decode=decode, n=n):
            n[0] += 1
            return decode(*args)

        monkeypatch.setattr(model, "decode", one)
        cache = prefilled(model, PROMPT[:-1])
        n[0] = 0
        forward1(model, cache, [PROMPT[-1]] + TREE, torch.tensor(PARENTS))
        counted.append(n[0])
    assert counted == [2, 1, 1]
    with pytest.raises(SpeculorError, match="calls must be one of"):
        llama.LlamaModel(draft.path, threads=2, calls="fast")
    from speculor import load_pair

    with pytest.raises(SpeculorError, match="llama.cpp setting"):
        load_pair(backend="torch", calls="batched")


def test_llama_cpps_own_prompt_lookup_runs_as_a_peer(llama_pair):
    """The bench's llama.cpp-lookup peer: llama-cpp-python's prompt-lookup drafting over the target's GGUF file
    answers a copy-heavy prompt (its greedy tokens are its own; not ours to guarantee), and so does its plain peer."""
    from speculor.bench.peers import PEERS, peer_generate

    assert "llama.cpp-lookup" in PEERS
    sp = Speculor(llama_pair, strategy="plain")
    ids = sp.encode("Return this function unchanged:\ndef f(x):\n    y = x + 1\n    return [x, y, x * y]", chat=True)
    cfg = SamplingConfig(max_new_tokens=24)
    for name in ("llama.cpp", "llama.cpp-lookup"):
        tokens, wall, first = peer_generate(llama_pair, name, ids, cfg, sp.eos_ids)
        assert 0 < len(tokens) <= 24 and 0 < first < wall, name


def test_the_servers_warm_up_makes_the_prompt_context_and_leaves_no_request_state(draft):
    """serving/app.py `warm_up` (run by `speculor serve` before its first request) leaves each llama.cpp model with
    its prompts' context made (else the first prompt makes it), no kept prompt, and the next greedy answer that of a
    model that was not warmed up."""
    from speculor.runtime.backend import Pair
    from speculor.serving.app import warm_up

    ctx, fresh = (llama.LlamaModel(draft.path, threads=2, n_ctx=2048) for _ in range(2))
    assert not ctx.prompt_contexts
    warm_up(Pair(ctx, fresh, None))
    assert ctx.prompt_contexts and fresh.prompt_contexts and not ctx.prompts
    cfg = SamplingConfig(max_new_tokens=6)
    prompt = (PROMPT * 3)[:40]
    assert [t.id for t in engine.stream(ctx, None, prompt, cfg)] == [t.id for t in engine.stream(
        llama.LlamaModel(draft.path, threads=2, n_ctx=2048), None, prompt, cfg)]
