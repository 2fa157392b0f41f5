"""Draft forwards batched across requests (engine/drafting.py, Model.forward, LeanDecoder.forward,
kernels.scale_rows): one draft forward per round for all requests; rows computed apart give a request the same
bits alone and in any batch (so a sampled request's output follows from its seed alone); the batch-aware budget
prices a draft row inside the shared forward; a failing request ends the step cleanly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.batch import PROMPTS, run_batch
from support.tiny import tiny_model

from speculor import SamplingConfig, engine
from speculor.drafters.base import BatchLedger, Drafter, Forward
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.ngram import NgramDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.drafters.values import worth
from speculor.engine import drafting
from speculor.engine.drafting import BatchPlan, drive, rounds
from speculor.errors import SpeculorError
from speculor.runtime.backend import Block, forward1
from speculor.runtime.cost import CostModel
from speculor.runtime.kernels import Int8Linear, apply, pack_linears, scale_rows
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")
fbgemm = pytest.mark.skipif(torch.backends.quantized.engine not in ("x86", "fbgemm"), reason="needs fbgemm")


def int8_draft(seed: int = 5) -> Model:
    model = tiny_model(seed, layers=2)
    pack_linears(model, Int8Linear)
    return Model(model, lean=True)


@pytest.fixture(scope="module")
def models() -> tuple[Model, Model]:
    return Model(tiny_model(0, pack=True)), int8_draft()


# ---------------------------------------------------------------- the kernel: rows apart

@fbgemm
def test_scaled_rows_are_computed_apart_and_per_call_rows_are_not() -> None:
    """Bitwise: a row's output through `scaled` is the same alone and beside any rows; the per-call kernel (the
    negative control) rounds a row by its neighbours' range. Both stay close to the fp32 product."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    k = Int8Linear(lin)
    x = torch.randn(12, 64) * torch.logspace(-2, 2, 12)[:, None]  # rows of very different scales
    with torch.inference_mode():
        whole = apply(k, scale_rows(x))
        for i in range(12):
            assert torch.equal(apply(k, scale_rows(x[i:i + 1])), whole[i:i + 1]), i
        assert torch.equal(apply(k, scale_rows(x[3:9])), whole[3:9])
        per_call = k(x)
        assert not torch.equal(k(x[:1]), per_call[:1])  # the small row, rounded with the large ones' step
        exact = lin(x)
    rel = ((whole - exact).norm(dim=1) / exact.norm(dim=1)).max()
    assert rel < 0.05
    assert ((per_call - exact).norm(dim=1) / exact.norm(dim=1)).max() > rel  # per-row steps fit small rows better


# ---------------------------------------------------------------- one lean forward for several requests

def _prefilled(model: Model, prompt: list[int]):
    cache = model.new_cache()
    forward1(model, cache, prompt)
    cache.keep(list(range(len(prompt))))
    return cache


@fbgemm
@pytest.mark.parametrize("apart", [True, False])
def test_forward_many_gives_each_call_its_own_result(models, apart: bool) -> None:
    """Calls of several kinds (a tree block, an appended depth, last=True, hidden=True) in one forward: each gets
    what it gets alone (the same bits with rows apart), and each cache only its own rows."""
    _, draft = models
    calls = lambda caches: [Block(caches[0], [5, 6, 7], torch.tensor([-1, 0, 0])),  # noqa: E731
                            Block(caches[1], [11], last=True),
                            Block(caches[2], [1, 2, 3, 4], hidden=True),
                            Block(caches[3], [9, 9], torch.tensor([-1, -1]), append=True)]
    alone_caches = [_prefilled(draft, p) for p in PROMPTS]
    forward1(draft, alone_caches[3], [8], torch.tensor([-1]))  # a pending row to append after
    alone = [draft.forward([c], apart=apart)[0] for c in calls(alone_caches)]
    caches = [_prefilled(draft, p) for p in PROMPTS]
    forward1(draft, caches[3], [8], torch.tensor([-1]))
    together = draft.forward(calls(caches), apart=apart)
    pairs = [(a, b) for x, y in zip(alone, together, strict=True)
             for a, b in [(x.logits, y.logits)] + ([(x.hidden, y.hidden)] if x.hidden is not None else [])]
    assert len(pairs) == 5 and all((x.hidden is None) == (y.hidden is None)
                                  for x, y in zip(alone, together, strict=True))
    for a, b in pairs:
        assert a.shape == b.shape
        assert torch.equal(a, b) if apart else (a - b).abs().max() < 0.2
    assert together[1].logits.shape == (1, 64)
    for c, d in zip(caches, alone_caches, strict=True):
        assert c.get_seq_length() == d.get_seq_length() and torch.equal(c.pending, d.pending)


def test_fp32_lean_rows_stack_like_separate_forwards() -> None:
    """A fp32 lean draft (no int8 kernel): two chains in one forward equal their own forwards."""
    model = Model(tiny_model(7), lean=True)
    a, b = _prefilled(model, PROMPTS[0]), _prefilled(model, PROMPTS[1])
    a2, b2 = _prefilled(model, PROMPTS[0]), _prefilled(model, PROMPTS[1])
    want = [forward1(model, a2, [4, 5]), forward1(model, b2, [6])]
    for apart in (False, True):
        got = model.forward([Block(a, [4, 5]), Block(b, [6])], apart=apart)
        for w, g in zip(want, got, strict=True):
            assert (w.logits - g.logits).abs().max() < 1e-5


# ---------------------------------------------------------------- the rounds

class Counting:
    """Counts the lean forwards of a draft model and the rows of each."""

    def __init__(self, model: Model) -> None:
        self.model, self.rows = model, []
        self.inner = model.lean.forward

    def __enter__(self):
        self.model.lean.forward = lambda blocks, *a, **k: self.rows.append(sum(b.stop - b.start for b in blocks)) \
            or self.inner(blocks, *a, **k)
        return self

    def __exit__(self, *exc):
        del self.model.lean.forward


@fbgemm
def test_a_steps_draft_forwards_are_one_per_round(models) -> None:
    """Four requests with chains of 3 and a tree of depth 2: a step makes 3 draft forwards, not 3 + 3 + 3 + 2."""
    target, draft = models
    cfg = SamplingConfig(max_new_tokens=1)
    reqs = [engine.start(target, d, p, cfg) for d, p in zip(
        [ChainDrafter(draft, 3), ChainDrafter(draft, 3), TreeDrafter(draft, [-1, -1, 0, 1]), ChainDrafter(draft, 3)],
        PROMPTS, strict=True)]
    with Counting(draft) as seen:
        trees, _ = drafting.propose_all(reqs, BatchPlan(len(reqs)))
    assert [len(t) for t in trees] == [3, 3, 4, 3]
    prompt_rows = sum(len(p) for p in PROMPTS)  # round 0: each request catches up its prompt
    assert seen.rows == [prompt_rows, 3 + 2, 3]  # round 1: three chain rows and the tree's two depth-1 nodes


@fbgemm
def test_batched_drafts_keep_greedy_output_and_a_seed_its_sample(models) -> None:
    """With an int8 lean draft whose forwards are batched: greedy requests emit the target's own tokens; a sampled
    request emits the same tokens alone and in two different batches, and others with another seed."""
    target, draft = models
    greedy = [SamplingConfig(max_new_tokens=n) for n in (9, 12, 7, 10)]
    makers = [lambda: ChainDrafter(draft, 3), lambda: TreeDrafter(draft, [-1, -1, 0, 1, 2], "swor"), lambda: None,
              lambda: NgramDrafter(k=4)]
    plain = [[t.id for t in engine.stream(target, None, p, c)] for p, c in zip(PROMPTS, greedy, strict=True)]
    assert run_batch(target, makers, PROMPTS, greedy) == plain
    mine = SamplingConfig(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=12)
    alone = [t.id for t in engine.stream(target, ChainDrafter(draft, 2), PROMPTS[0], mine)]
    others = [SamplingConfig(temperature=1.3, seed=8, max_new_tokens=9), SamplingConfig(max_new_tokens=15),
              SamplingConfig(temperature=0.6, seed=1, max_new_tokens=11)]
    tree = lambda: TreeDrafter(draft, [-1, -1, 0], "iid")  # noqa: E731
    assert run_batch(target, [lambda: ChainDrafter(draft, 2), tree, lambda: ChainDrafter(draft, 4), tree],
                     PROMPTS, [mine, *others])[0] == alone
    assert run_batch(target, [lambda: ChainDrafter(draft, 2), tree], PROMPTS[:2], [mine, others[0]])[0] == alone
    other_seed = SamplingConfig(temperature=0.9, top_p=0.95, seed=8, max_new_tokens=12)
    assert run_batch(target, [lambda: ChainDrafter(draft, 2), tree], PROMPTS[:2], [other_seed, others[0]])[0] != alone


class Failing(Drafter):
    """A drafter whose propose fails after one draft forward; `closed` once its proposal was ended from outside."""

    def __init__(self, model: Model, after: int = 1) -> None:
        self.model, self.cache, self.after, self.closed = model, model.new_cache(), after, False

    def propose(self, seq, cfg, generator):
        try:
            for _ in range(self.after):
                yield Forward(self.model, Block(self.cache, seq))
        except GeneratorExit:
            self.closed = True
            raise
        raise SpeculorError("draft logits are not finite")


@fbgemm
def test_a_failing_request_fails_the_step_and_ends_the_others_proposals(models) -> None:
    target, draft = models
    cfg = SamplingConfig(max_new_tokens=4)
    waiting = Failing(draft, after=3)  # still waiting for its second forward when the other fails
    reqs = [engine.start(target, d, p, cfg) for d, p in zip(
        [ChainDrafter(draft, 3), Failing(draft), waiting], PROMPTS[:3], strict=True)]
    with pytest.raises(SpeculorError, match="not finite"):
        drafting.propose_all(reqs, BatchPlan(3))
    assert waiting.closed  # its proposal was ended where it waited, not left suspended
    with pytest.raises(ZeroDivisionError):
        rounds([_raising()], apart=False)
    trees, _ = drafting.propose_all([engine.start(target, ChainDrafter(draft, 2), p, cfg) for p in PROMPTS[:3]],
                                    BatchPlan(3))
    assert [len(t) for t in trees] == [2, 2, 2]  # the next step drafts as usual


def _raising():
    yield from ()
    return 1 / 0


# ---------------------------------------------------------------- the batch-aware budget inside shared forwards

FLAT = CostModel((1, 2, 64), (0.30, 0.33, 2.0), (1, 16, 64), (0.06, 0.09, 0.2))


def test_a_plan_view_sees_the_others_rows_tokens_and_shared_draft_forwards() -> None:
    plan = BatchPlan(3)
    plan.drafted(0, 0, 4)
    plan.drafted(0, 1, 1)
    seat = plan.view(2)
    assert seat.draft_rows == [5]
    assert seat.draft_s(FLAT.t_draft) == pytest.approx(FLAT.t_draft(5))  # one shared forward of 5 rows
    seat.publish(7, 3.5)
    assert (plan.view(0).rows, plan.view(0).tokens) == (1 + 7, 1.0 + 3.5)
    assert BatchLedger().draft_s(FLAT.t_draft) == 0.0


@fbgemm
def test_batch_aware_dyspec_with_batched_drafts_keeps_greedy_output(models) -> None:
    target, draft = models
    cfg = SamplingConfig(max_new_tokens=8)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    want = [[t.id for t in engine.stream(target, None, p, cfg)] for p in prompts]
    opts = DySpecOptions(budget="auto")
    assert run_batch(target, [lambda: DySpecDrafter(draft, opts, FLAT)] * 6, prompts, [cfg] * 6) == want


@fbgemm
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_proposal_driven_alone_gives_the_tree_it_gives_inside_a_batch(models, temperature: float) -> None:
    """Each drafter's generator driven alone (`drive`) and driven round by round beside other requests' proposals
    (`propose_all`): the same tree, token for token, and the same q (rows computed apart when sampling)."""
    target, draft = models
    makers = [lambda: ChainDrafter(draft, 3), lambda: TreeDrafter(draft, [-1, -1, 0, 1, 2], "swor"),
              lambda: DySpecDrafter(draft, DySpecOptions(budget=6)), lambda: NgramDrafter(k=4)]
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=4)
    apart = temperature > 0
    for i, make in enumerate(makers):
        alone = drive(make().propose(PROMPTS[i], cfg, torch.Generator().manual_seed(i)), apart=apart)
        reqs = [engine.start(target, m(), p, replace(cfg, seed=i if j == i else 50 + j))
                for j, (m, p) in enumerate(zip(makers, PROMPTS, strict=True))]
        together = drafting.propose_all(reqs, BatchPlan(len(reqs)))[0][i]
        assert torch.equal(alone.tokens, together.tokens) and torch.equal(alone.parents, together.parents)
        assert (alone.q is None) == (together.q is None)
        if alone.q is not None:
            assert torch.equal(alone.q, together.q)


# ---------------------------------------------------------------- joint rounds: each draft round priced once

# the embedded pair's shape on the project CPU: a target forward ~flat to 8 rows, a draft round ~30 ms for 1 row and
# ~36 ms for 8: most of a round is paid whoever drafts in it
ROUNDS = CostModel((1, 8, 64), (0.234, 0.282, 1.2), (1, 8, 64), (0.030, 0.036, 0.2))


def test_settle_prices_a_round_once_for_all_its_bids() -> None:
    plan = BatchPlan(4)
    bids = [drafting.RoundBid(plan, ROUNDS, 0.3, 1, 1) for _ in range(4)]
    assert drafting.settle(bids) == [True] * 4  # (4 + 1.2) / (36 ms + t(8)) beats 4 / t(4)
    # negative control: the same bid priced alone, as the request-by-request rule prices it, does not pay
    assert not worth(ROUNDS, 0, 0.0, 0.0, 0.3, 1, ROUNDS.t_draft(1), plan.view(0))
    assert drafting.settle(bids[:1]) == [False]  # one bid carries the whole round: it does not pay either
    assert drafting.settle([drafting.RoundBid(plan, ROUNDS, 0.02, 1, 1) for _ in range(4)]) == [False] * 4


def test_settle_leaves_out_a_bid_whose_rows_cost_more_than_it_brings() -> None:
    plan = BatchPlan(4)
    far = drafting.RoundBid(plan, ROUNDS, 0.8, 1, 50)  # a draft cache 50 tokens behind: its catch-up is 50 rows
    near = [drafting.RoundBid(plan, ROUNDS, 0.8, 1, 1) for _ in range(3)]
    assert drafting.settle([far, *near]) == [False, True, True, True]
    plan.extra = 60  # a prompt chunk in the step makes every target row dearer: still judged jointly
    assert drafting.settle(near) == [True] * 3


def test_bids_of_a_round_are_settled_together_before_its_forward() -> None:
    """Proposals bid through their seats: each gets the joint answer; driven alone, or with joint=False, a bid is
    answered None (the drafter decides alone)."""
    plan = BatchPlan(3)
    seats = [plan.view(i) for i in range(3)]
    gains = [0.3, 0.3, 0.3]
    got = rounds([_bidder(s, g) for s, g in zip(seats, gains, strict=True)], apart=False)
    assert got == [True, True, True]
    lone = rounds([_bidder(seats[0], 0.3), _no_bid()], apart=False)
    assert lone == [False, "no bid"]  # the other proposal bid nothing: the round would be this bid's alone
    assert drive(_bidder(seats[0], 0.3)) is None  # driven alone: it decides alone
    assert rounds([_bidder(s, 0.3) for s in seats], apart=False, joint=False) == [None] * 3


def _bidder(seat, gain: float):
    return (yield from seat.round(ROUNDS, gain, 1, 1))


def _no_bid():
    yield from ()
    return "no bid"


def test_settle_charges_a_catch_up_share_to_its_own_bid() -> None:
    plan = BatchPlan(2)
    near = drafting.RoundBid(plan, ROUNDS, 0.8, 1, 1)
    assert drafting.settle([near, drafting.RoundBid(plan, ROUNDS, 0.8, 1, 1, once=0.5)]) == [True, False]
    assert drafting.settle([near, drafting.RoundBid(plan, ROUNDS, 0.8, 1, 1, once=0.001)]) == [True, True]


@fbgemm
def test_batch_aware_dyspec_drafts_in_shared_rounds(models) -> None:
    """Four requests at their first step bid for a first draft token, their prompts' catch-up charged over the 64
    tokens to come: all go ahead and catch up in one round-0 forward; greedy output is unchanged."""
    target, draft = models
    cfg = SamplingConfig(max_new_tokens=64)
    drafters = [DySpecDrafter(draft, DySpecOptions(budget="auto"), ROUNDS) for _ in range(4)]
    reqs = [engine.start(target, d, p, cfg) for d, p in zip(drafters, PROMPTS, strict=True)]
    plan = BatchPlan(len(reqs))
    trees, _ = drafting.propose_all(reqs, plan)
    assert not any(d.skipped for d in drafters) and all(len(t) >= 1 for t in trees)
    assert plan.draft[0] == [len(r.seq) for r in reqs]  # round 0: the four catch-ups in one forward
    cfg = SamplingConfig(max_new_tokens=8)
    want = [[t.id for t in engine.stream(target, None, p, cfg)] for p in PROMPTS]
    made = [lambda: DySpecDrafter(draft, DySpecOptions(budget="auto"), ROUNDS)] * 4
    assert run_batch(target, made, PROMPTS, [cfg] * 4) == want
