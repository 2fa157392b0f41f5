"""Batched decoding (engine/batch.py, runtime/batched.py): one target forward for several requests, each attending to
its own cache; a request's output does not depend on its batch (greedy: token for token; sampled: the exact law,
and with fixed trees the same sample for the same seed); the batch-aware budget falls back to plain decoding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.batch import PROMPTS, run_batch
from support.stats import goodness_of_fit
from support.tiny import VOCAB, tiny_model
from support.toy import PROMPT, N, V, exact_law, perturbed

from speculor import SamplingConfig, engine
from speculor.core.tree import block_parents
from speculor.drafters.base import BatchLedger
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.ngram import NgramDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.drafters.values import worth
from speculor.engine import batch as batched_engine
from speculor.engine.drafting import drive
from speculor.runtime.backend import Block, forward1
from speculor.runtime.cost import CostModel
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair() -> tuple[Model, Model]:
    # packed with the engine's kernels: oneDNN's multi-row GEMM gives every row the same bits in any batch
    return Model(tiny_model(0, pack=True)), Model(tiny_model(1, layers=1, pack=True))


def prefilled(model: Model, prompt: list[int]):
    cache = model.new_cache()
    forward1(model, cache, prompt)
    cache.keep(list(range(len(prompt))))
    return cache


def test_one_forward_gives_each_block_its_own_logits(pair):
    target, _ = pair
    assert target.batched
    blocks = [([5, 6, 7], [-1, 0]), ([11], []), ([1, 2, 3, 4], [-1, -1, 0]), ([9, 9], [-1])]
    alone = [forward1(target, prefilled(target, p), t, block_parents(torch.tensor(par, dtype=torch.long))).logits
             for p, (t, par) in zip(PROMPTS, blocks, strict=True)]
    caches = [prefilled(target, p) for p in PROMPTS]
    calls = target.model.model.embed_tokens.forward
    counted = []
    target.model.model.embed_tokens.forward = lambda x: counted.append(x.shape) or calls(x)
    try:
        together = [r.logits for r in target.forward([Block(c, t, block_parents(torch.tensor(par, dtype=torch.long)))
                                                      for c, (t, par) in zip(caches, blocks, strict=True)])]
    finally:
        target.model.model.embed_tokens.forward = calls
    assert counted == [torch.Size([1, 10])]  # one forward over the 10 stacked rows
    for a, b, (t, _) in zip(alone, together, blocks, strict=True):
        assert b.shape == (len(t), VOCAB)
        assert (a - b).abs().max() < 1e-5
        if len(t) > 1:  # multi-row blocks: the very same bits as alone
            assert torch.equal(a, b)
    for c, p, (t, _) in zip(caches, PROMPTS, blocks, strict=True):  # each cache got its own rows, and only them
        assert c.get_seq_length() == len(p) + len(t) and c.length == len(p)


@pytest.mark.parametrize("root", [False, True])
def test_batched_greedy_is_token_identical_to_each_request_alone(pair, monkeypatch, root):
    target, draft = pair
    # the first step scores the root, or the prompt's call
    monkeypatch.setattr(target, "traits", replace(target.traits, root_in_prompt=root))
    makers = [lambda: None, lambda: ChainDrafter(draft, 3), lambda: TreeDrafter(draft, [-1, -1, 0, 1, 2], "swor"),
              lambda: NgramDrafter(k=4)]
    cfgs = [SamplingConfig(max_new_tokens=n) for n in (10, 14, 7, 12)]
    alone = [[t.id for t in engine.stream(target, make(), p, c)] for make, p, c in zip(makers, PROMPTS, cfgs,
                                                                                      strict=True)]
    assert run_batch(target, makers, PROMPTS, cfgs) == alone
    assert run_batch(target, makers[1:3], PROMPTS[1:3], cfgs[1:3]) == alone[1:3]  # other neighbours, same output


def test_a_sampled_request_depends_on_its_own_seed_only(pair):
    """Fixed trees: a request's sample is the same alone and in two different batches (other seeds, temperatures,
    strategies); it changes with its own seed."""
    target, draft = pair
    mine = SamplingConfig(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=12)
    alone = [t.id for t in engine.stream(target, ChainDrafter(draft, 2), PROMPTS[0], mine)]
    others = [SamplingConfig(temperature=1.3, seed=8, max_new_tokens=9), SamplingConfig(max_new_tokens=15)]
    got = run_batch(target, [lambda: ChainDrafter(draft, 2), lambda: TreeDrafter(draft, [-1, -1, 0], "iid"),
                             lambda: None], PROMPTS[:3], [mine, *others])
    assert got[0] == alone
    got = run_batch(target, [lambda: ChainDrafter(draft, 2), lambda: NgramDrafter()], PROMPTS[:2], [mine, others[1]])
    assert got[0] == alone
    other_seed = SamplingConfig(temperature=0.9, top_p=0.95, seed=8, max_new_tokens=12)
    assert run_batch(target, [lambda: ChainDrafter(draft, 2)], PROMPTS[:1], [other_seed])[0] != alone


# ---------------------------------------------------------------- the exact law, batched (toy LM, chi-square)

MIXED = [(lambda d: ChainDrafter(d, 2), SamplingConfig(temperature=1.0, max_new_tokens=N)),
         (lambda d: TreeDrafter(d, [-1, -1, 0, 1], "swor"), SamplingConfig(temperature=0.7, top_p=0.9,
                                                                             max_new_tokens=N)),
         (lambda d: TreeDrafter(d, [-1, -1, -1], "iid"), SamplingConfig(temperature=1.3, max_new_tokens=N + 2))]


def batched_counts(target, draft, m: int, seed0: int) -> list[torch.Tensor]:
    """Counts [V]*N of each request's first N tokens over m batches of the three MIXED requests."""
    t_model, d_model = Model(target), Model(draft)
    counts = [torch.zeros([V] * N, dtype=torch.float64) for _ in MIXED]
    for j in range(m):
        entries = [(make(d_model), PROMPT, SamplingConfig(temperature=c.temperature, top_p=c.top_p, seed=seed0 + 3 * j
                                                          + i, max_new_tokens=c.max_new_tokens))
                   for i, (make, c) in enumerate(MIXED)]
        out: list[list[int]] = [[] for _ in MIXED]
        for i, toks in batched_engine.generate(t_model, entries):
            out[i].extend(t.id for t in toks)
        for i, o in enumerate(out):
            counts[i][tuple(o[:N])] += 1
    return counts


def test_batched_sampling_follows_the_exact_law(target):
    for (_, cfg), counts in zip(MIXED, batched_counts(target, perturbed(target, seed=1, noise=0.8), 2500, 5000),
                                strict=True):
        pvalue, tv, floor = goodness_of_fit(counts, exact_law(target, PROMPT, cfg, N))
        assert pvalue > 1e-3, f"T={cfg.temperature}: chi-square p-value {pvalue:.2e} (TV {tv:.4f}, floor {floor:.4f})"
        assert tv < 2 * floor


def test_batched_dyspec_with_joint_rounds_follows_the_exact_law(target, monkeypatch):
    """Three batch-aware DySpec requests (auto budget, each draft round settled jointly from all their bids, so a
    request's tree depends on its batch; unseeded, as a seeded request sizes its tree as if alone): the first
    request's law is still the target's."""
    from speculor.engine import drafting

    seen, settle = [], drafting.settle
    monkeypatch.setattr(drafting, "settle", lambda bids: seen.extend(answer := settle(bids)) or answer)
    cost = CostModel((1, 8, 64), (0.234, 0.282, 1.2), (1, 8, 64), (0.030, 0.036, 0.2))
    t_model, d_model = Model(target), Model(perturbed(target, seed=1, noise=0.8))
    counts = torch.zeros([V] * N, dtype=torch.float64)
    torch.manual_seed(20000)  # unseeded requests draw from torch's global generator
    for _ in range(2500):
        entries = [(DySpecDrafter(d_model, DySpecOptions(budget="auto"), cost), PROMPT + [i] * (i > 0),
                    SamplingConfig(temperature=1.0, max_new_tokens=N)) for i in range(3)]
        out: list[int] = []
        for i, toks in batched_engine.generate(t_model, entries):
            out.extend(t.id for t in toks if i == 0)
        counts[tuple(out)] += 1
    assert True in seen and False in seen  # bids went ahead and bids were declined
    pvalue, tv, floor = goodness_of_fit(counts, exact_law(target, PROMPT, SamplingConfig(temperature=1.0), N))
    assert pvalue > 1e-3 and tv < 2 * floor, f"p-value {pvalue:.2e}, TV {tv:.4f}, floor {floor:.4f}"


def test_a_seeded_request_gets_its_sample_in_any_batch(target):
    """Under the batch-aware budget a request's tree depends on its batch (joint draft rounds), so a seeded request
    sizes its tree as if alone: the same seed gives the same tokens alone and beside unseeded neighbours."""
    cost = CostModel((1, 8, 64), (0.234, 0.282, 1.2), (1, 8, 64), (0.030, 0.036, 0.2))
    t_model, d_model = Model(target), Model(perturbed(target, seed=1, noise=0.8))
    make = lambda: DySpecDrafter(d_model, DySpecOptions(budget="auto"), cost)  # noqa: E731
    torch.manual_seed(0)
    for seed in range(12):
        mine = SamplingConfig(temperature=1.0, seed=seed, max_new_tokens=12)
        alone = [t.id for t in engine.stream(t_model, make(), PROMPT, mine)]
        cfgs = [mine] + [SamplingConfig(temperature=1.0, max_new_tokens=12)] * 3
        prompts = [PROMPT] + [PROMPT + [i] for i in range(1, 4)]
        assert run_batch(t_model, [make] * 4, prompts, cfgs)[0] == alone, seed


def test_chi_square_catches_rows_verified_against_another_request(target, monkeypatch):
    """Negative control: a batch whose logits reach the wrong requests (rotated by one) must be caught."""
    forward = Model.forward

    def rotated(self, blocks, **kw):
        out = [forward(self, [b], **kw)[0] for b in blocks]
        return out[1:] + out[:1]
    monkeypatch.setattr(Model, "forward", rotated)
    t_model = Model(target)
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for j in range(1500):
        entries = [(None, PROMPT, SamplingConfig(temperature=1.0, seed=9000 + 2 * j, max_new_tokens=N)),
                   (None, PROMPT + [0], SamplingConfig(temperature=0.5, seed=9001 + 2 * j, max_new_tokens=N))]
        out: list[list[int]] = [[], []]
        for i, toks in batched_engine.generate(t_model, entries):
            out[i].extend(t.id for t in toks)
        counts[tuple(out[0])] += 1
    pvalue, tv, _ = goodness_of_fit(counts, exact_law(target, PROMPT, SamplingConfig(temperature=1.0), N))
    assert pvalue < 1e-6, f"rows of another request not detected: p-value {pvalue:.2e}, TV {tv:.4f}"


# ---------------------------------------------------------------- the batch-aware budget

FLAT = CostModel((1, 2, 64), (0.30, 0.33, 2.0), (1, 64), (0.06, 0.2))  # target 0.3 s for 1 row, ~26 ms per row after


def test_worth_in_a_batch_charges_the_whole_batch():
    assert worth(FLAT, 0, 0.0, 0.0, 0.8, 1, 0.06)  # alone: a likely draft token pays for itself
    crowd = BatchLedger(rows=15, tokens=15.0, pending=0)
    assert not worth(FLAT, 0, 0.0, 0.0, 0.8, 1, 0.06, crowd)  # 15 others decoding plainly: it does not
    assert not worth(FLAT, 0, 0.0, 0.0, 0.8, 1, 0.06, BatchLedger(pending=15))  # first of 16: the rest count too
    assert worth(FLAT, 0, 0.0, 0.0, 0.8, 1, 0.06, BatchLedger())  # an empty ledger is the single-request rule


def test_batch_aware_dyspec_decodes_plainly_under_load(pair):
    target, draft = pair
    opts = DySpecOptions(budget="auto")
    d = DySpecDrafter(draft, opts, FLAT)
    d.ledger = BatchLedger(rows=15, tokens=15.0, pending=0)
    tree = drive(d.propose(PROMPTS[0], SamplingConfig(), None))
    assert len(tree) == 0 and d.forwards == 0 and d.skipped
    d.ledger = BatchLedger()
    tree = drive(d.propose(PROMPTS[0], SamplingConfig(), None))
    assert len(tree) >= 1 and d.forwards >= 1 and not d.skipped
    # in a batch of 16 identical-cost requests, greedy output is still each request's own
    cfg = SamplingConfig(max_new_tokens=8)
    makers = [lambda: DySpecDrafter(draft, opts, FLAT)] * 16
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    alone = [[t.id for t in engine.stream(target, None, p, cfg)] for p in prompts[:4]]
    got = run_batch(target, makers, prompts, [cfg] * 16)
    assert got[:4] == alone


def test_a_catch_up_is_charged_over_the_tokens_left(pair):
    """A draft cache 40 tokens behind (after steps decoded plainly beside others): its catch-up is an investment in
    the rest of the generation, charged spread over the tokens left. Beside one other request, with most of the
    generation left it drafts; with 2 tokens left it decodes plainly, and counts as its root from then on."""
    from speculor.core.verify import Verdict

    _, draft = pair

    def behind_by_40(max_new_tokens: int) -> tuple[DySpecDrafter, int]:
        d = DySpecDrafter(draft, DySpecOptions(budget="auto"), FLAT)
        cfg, seq = SamplingConfig(max_new_tokens=max_new_tokens), [(7 * i) % VOCAB for i in range(4)]
        d.ledger = BatchLedger()
        assert len(drive(d.propose(seq, cfg, None))) >= 1 and not d.skipped and d.estimate[0] > 1
        d.observe(len(seq), Verdict([], 5))
        d.ledger = BatchLedger(rows=1, tokens=1.0)
        return d, len(drive(d.propose(seq + [5] + [(3 * i) % VOCAB for i in range(40)], cfg, None)))

    d, size = behind_by_40(44)  # 42 tokens generated, 2 left
    assert size == 0 and d.skipped and d.estimate == (1, 1.0)  # not its last tree: a skipped request is a root
    d, size = behind_by_40(400)
    assert size >= 1 and not d.skipped


def test_batch_aware_sequoia_sizes_its_tree_for_the_batch(pair):
    """Sequoia's auto budget in a batch: alone it picks the plan's tree (the single-stream choice); behind 15
    requests decoding plainly a draft row costs more than it returns, so it decodes plainly; greedy output is
    each request's own either way."""
    from speculor.drafters.sequoia import SequoiaOptions, SequoiaPlans

    target, draft = pair
    plans = SequoiaPlans(draft, "t", "d", SequoiaOptions("auto", depth=4, width=4, acc=(0.6, 0.1, 0.05, 0.02)), FLAT)
    cfg = SamplingConfig(max_new_tokens=8)
    alone = plans.for_batch(cfg, BatchLedger())
    assert alone is not None and alone.shape == plans.plan(cfg).shape
    assert plans.for_batch(cfg, BatchLedger(rows=15, tokens=15.0)) is None
    d = plans.drafter()
    d.ledger = BatchLedger(rows=15, tokens=15.0)
    assert len(drive(d.propose(PROMPTS[0], cfg, None))) == 0 and d.skipped and d.forwards == 0
    d.ledger = BatchLedger()
    assert len(drive(d.propose(PROMPTS[0] + [5], cfg, None))) == len(alone.shape) and not d.skipped
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    want = [[t.id for t in engine.stream(target, None, p, cfg)] for p in prompts]
    assert run_batch(target, [plans.drafter] * 6, prompts, [cfg] * 6) == want


# ---------------------------------------------------------------- chunked prefill inside the batched steps

def run_joining(target, makers, prompts, cfgs, chunk: int, join_at: int) -> tuple[list[list[int]], list[int]]:
    """Request 0 runs alone; the others join (prefill=False) after `join_at` steps and fill their prompts `chunk`
    tokens a step. Returns every request's tokens and request 0's emitted count at each step."""
    reqs = [batched_engine.Active(engine.start(target, makers[0](), prompts[0], cfgs[0]), frozenset())]
    out: list[list[int]] = [[] for _ in prompts]
    per_step, steps = [], 0
    while any(not a.done for a in reqs):
        if steps == join_at:
            reqs += [batched_engine.Active(engine.start(target, make(), p, c, prefill=False, chunk=chunk), frozenset())
                     for make, p, c in zip(makers[1:], prompts[1:], cfgs[1:], strict=True)]
        active = [a for a in reqs if not a.done]
        for a, toks in zip(active, batched_engine.step(target, active), strict=True):
            out[reqs.index(a)].extend(t.id for t in toks)
            if a is reqs[0]:
                per_step.append(len(toks))
        steps += 1
    return out, per_step


def _recording(forward, chunks: list[tuple[int, bool]]):
    """forward that first notes (length, last) of every prompt block (a chain block: a whole prompt's prefill in
    `engine.start`, or a chunk) it gets."""
    def run(blocks, **kw):
        chunks.extend((len(b.tokens), b.last) for b in blocks if b.parents is None)
        return forward(blocks, **kw)
    return run


@pytest.mark.parametrize("root", [False, True])
def test_a_joining_request_is_prefilled_in_chunks_without_stalling_the_running_one(pair, monkeypatch, root):
    """Greedy and sampled: every request emits what it emits alone; the running request emits tokens at every step
    while the joiners fill their prompts (2 tokens a step: up to 5 steps for the 9-token prompt), asking for no
    logits but their last row's (the root's, where the prompt's call scores it: root_in_prompt)."""
    target, draft = pair
    monkeypatch.setattr(target, "traits", replace(target.traits, root_in_prompt=root))
    makers = [lambda: ChainDrafter(draft, 2), lambda: None, lambda: TreeDrafter(draft, [-1, -1, 0], "swor")]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    for cfgs in ([SamplingConfig(max_new_tokens=n) for n in (16, 6, 8)],
                 [SamplingConfig(temperature=0.8, seed=s, max_new_tokens=n) for s, n in ((1, 16), (2, 6), (3, 8))]):
        alone = [[t.id for t in engine.stream(target, make(), p, c)] for make, p, c in zip(makers, prompts, cfgs,
                                                                                          strict=True)]
        chunks: list[tuple[int, bool]] = []
        target.forward = _recording(target.forward, chunks)
        try:
            got, per_step = run_joining(target, makers, prompts, cfgs, chunk=2, join_at=2)
        finally:
            del target.forward
        assert got == alone
        assert len(per_step) >= 6 and all(n >= 1 for n in per_step)  # never held up by the joiners' prefill
        # request 0's prefill, then 9 and 6 prompt tokens (less their roots), at most 2 a step, in the steps
        want = [3, 1] + [2] * 7 if root else [len(prompts[0]) - 1, 1] + [2] * 6
        assert sorted(n for n, _ in chunks) == sorted(want)
        assert all(last for _, last in chunks)


def test_prefill_chunks_do_not_depend_on_the_batch(pair):
    """A request filled in chunks emits the same tokens whoever runs beside it, and the chunk rows are the ledger's."""
    target, _ = pair
    req = engine.start(target, None, PROMPTS[2], SamplingConfig(max_new_tokens=3), prefill=False, chunk=4)
    assert req.unfilled == len(PROMPTS[2]) - 1 and req.cache.length == 0
    assert batched_engine._chunk(req) == PROMPTS[2][:4]
    batched_engine.step(target, [batched_engine.Active(req, frozenset())])
    assert req.unfilled == 4 and req.cache.length == 4 and batched_engine._chunk(req) == PROMPTS[2][4:8]
    batched_engine.step(target, [batched_engine.Active(req, frozenset())])
    assert req.unfilled == 0 and req.cache.length == 8 and req.stats.steps == []
    lent = engine.start(target, None, PROMPTS[2], SamplingConfig(max_new_tokens=3), prefill=False, chunk=4)
    lent.unfilled -= 3  # as a prompt memory lends 3 cells: the next chunk ends on the grid
    assert batched_engine._chunk(lent) == PROMPTS[2][3:4]
    long = engine.start(target, None, list(range(1, 22)), SamplingConfig(max_new_tokens=3), prefill=False, chunk=8)
    assert batched_engine._chunk(long, 8) == list(range(1, 9))  # 12 left after it: a chunk on the grid
    long.unfilled -= 8
    assert batched_engine._chunk(long, 8) == list(range(9, 21))  # 4 left after 8 more: it takes them (least 8)
    assert batched_engine._chunk(long) == list(range(9, 17))
    whole = engine.start(target, None, PROMPTS[2], SamplingConfig(max_new_tokens=3))
    assert torch.allclose(req.cache.layers[0].keys[..., :8, :], whole.cache.layers[0].keys[..., :8, :], atol=1e-5)


def test_prompts_take_more_chunks_a_step_while_none_decodes(pair, monkeypatch):
    """With a backend's fill_rows, a step in which no request decodes fills every filler's prompt in whole chunks,
    an equal share of fill_rows each; a step beside a decoding request one chunk; the calls on the grid and every
    request's tokens its own alone. Without fill_rows (torch's 0), one chunk a step."""
    target, _ = pair
    cfg = SamplingConfig(max_new_tokens=4)
    prompts = [list(range(1, 42)), list(range(50, 60))]  # 40 and 9 prompt rows before the roots
    alone = [[t.id for t in engine.stream(target, None, p, cfg)] for p in prompts]
    req = engine.start(target, None, prompts[0], cfg, prefill=False, chunk=4)
    assert batched_engine._chunk(req, 1, 3) == prompts[0][:12]
    req.unfilled -= 3  # as a prompt memory lends 3 cells: the span ends on the grid
    assert batched_engine._chunk(req, 1, 3) == prompts[0][3:12]
    req.unfilled -= 21
    assert batched_engine._chunk(req, 8, 3) == prompts[0][24:40]  # 4 left after 12: the rest joins the chunk
    # 16 rows: 8 each, then the short prompt decodes (4 a step for the long one), then the long one alone its rest
    for fill_rows, calls in ((16, [8, 8, 8, 1, 4, 4, 4, 4, 8]), (0, [4, 4, 4, 4, 4, 1] + [4] * 7)):
        monkeypatch.setattr(target, "traits", replace(target.traits, fill_rows=fill_rows))
        chunks: list[tuple[int, bool]] = []
        target.forward = _recording(target.forward, chunks)
        try:
            batch = [batched_engine.Active(engine.start(target, None, p, cfg, prefill=False, chunk=4), frozenset())
                     for p in prompts]
            out: list[list[int]] = [[], []]
            while not all(a.done for a in batch):
                active = [a for a in batch if not a.done]
                for a, toks in zip(active, batched_engine.step(target, active), strict=True):
                    out[batch.index(a)].extend(t.id for t in toks)
        finally:
            del target.forward
        assert out == alone
        assert [n for n, _ in chunks] == calls


def test_batch_aware_drafters_do_not_draft_while_a_prompt_is_filled_beside_them(pair):
    """A prompt chunk in the step: batch-aware DySpec decodes plainly (its neighbour's fill is not held up by draft
    rounds); the step after the fill it drafts again, and its tokens are its own throughout."""
    target, draft = pair
    cfg = SamplingConfig(max_new_tokens=12)
    d = DySpecDrafter(draft, DySpecOptions(budget="auto"), FLAT)
    running = batched_engine.Active(engine.start(target, d, PROMPTS[0], cfg), frozenset())
    joiner = batched_engine.Active(engine.start(target, None, PROMPTS[2], SamplingConfig(max_new_tokens=2),
                                                prefill=False, chunk=4), frozenset())
    batched_engine.step(target, [running])
    assert not d.skipped  # alone: it drafts
    batched_engine.step(target, [running, joiner])
    assert d.skipped and d.forwards == 0 and joiner.req.unfilled > 0
    while joiner.req.unfilled:
        batched_engine.step(target, [running, joiner])
    batched_engine.step(target, [running])
    assert not d.skipped
    want = [t.id for t in engine.stream(target, None, PROMPTS[0], cfg)]
    assert running.req.seq[len(PROMPTS[0]):] == want[:len(running.req.seq) - len(PROMPTS[0])]
