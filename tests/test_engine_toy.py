"""Full decoding through `speculor.engine.stream` with toy LMs: greedy equality, exact law (chi-square), EOS, length."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from support.stats import goodness_of_fit
from support.toy import PROMPT, N, ToyLM, V, exact_law, next_distribution, perturbed, plain_greedy, random_toy

import speculor.core.verify
from speculor import engine
from speculor.config import SamplingConfig
from speculor.drafters.chain import ChainDrafter
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(target: ToyLM, draft: ToyLM | None, prompt: list[int], cfg: SamplingConfig, k: int = 2,
             eos: frozenset[int] = frozenset(), stats: engine.Stats | None = None, root: bool = False
             ) -> list[engine.Token]:
    """engine.stream's tokens; root: the target scores the root in the prompt's last call (`root_in_prompt`)."""
    drafter = ChainDrafter(Model(draft), k) if draft is not None else None
    model = Model(target)
    model.traits = replace(model.traits, root_in_prompt=root)
    return list(engine.stream(model, drafter, prompt, cfg, eos, stats))


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("prompt", [[0], [1, 2], [5, 4, 3, 2], [3, 3, 3]])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("root", [False, True])
def test_greedy_equals_plain_greedy(target, draft, prompt, k, root):
    cfg = SamplingConfig(max_new_tokens=17)
    spec = [t.id for t in generate(target, draft, prompt, cfg, k, root=root)]
    assert spec == plain_greedy(target, prompt, 17)
    assert [t.id for t in generate(target, None, prompt, cfg, root=root)] == spec


def counting(forward, rows: list[int]):
    """forward that first notes the rows of every block it gets."""
    def run(blocks, **kw):
        rows.extend(len(b.tokens) for b in blocks)
        return forward(blocks, **kw)
    return run


@pytest.mark.parametrize("k", [0, 3])
def test_the_prompts_last_call_scores_the_root(target, draft, k):
    """With root_in_prompt the prompt's call gives the root's logits: the first step draws its token from them with
    no call and no draft (plain decoding makes one call fewer), the drafter drafts from the second step on; the
    tokens are the same."""
    cfg = SamplingConfig(max_new_tokens=9)
    got = {}
    for root in (False, True):
        model = Model(target)
        model.traits = replace(model.traits, root_in_prompt=root)
        rows: list[int] = []
        model.forward = counting(model.forward, rows)
        drafter = ChainDrafter(Model(draft), k) if k else None
        stats = engine.Stats()
        got[root] = [t.id for t in engine.stream(model, drafter, [5, 4, 3, 2], cfg, stats=stats)], rows, stats
    (plain, rows, stats), (ours, ours_rows, our_stats) = got[False], got[True]
    assert ours == plain == plain_greedy(target, [5, 4, 3, 2], 9)
    assert rows[0] == 3 and ours_rows[0] == 4  # the prompt less its root, the whole prompt
    assert our_stats.steps[0].drafted == 0 and our_stats.steps[0].draft_forwards == 0
    if not k:
        assert ours_rows[1:] == [1] * 8 and rows[1:] == [1] * 9
    else:
        assert rows[1] == ours_rows[1] == k + 1  # the first tree, [root] + k: the first step's, or the second's
        assert stats.steps[0].drafted == k


def test_greedy_with_other_draft_tables():
    """Target and draft with unrelated tables (few acceptances) still give the target's greedy output."""
    target, other = random_toy(V, seed=3), random_toy(V, seed=4)
    for prompt in ([2], [4, 0, 1]):
        out = [t.id for t in generate(target, other, prompt, SamplingConfig(max_new_tokens=12), k=3)]
        assert out == plain_greedy(target, prompt, 12)


@pytest.mark.parametrize("cfg", [SamplingConfig(max_new_tokens=13),
                                 SamplingConfig(temperature=1.0, max_new_tokens=13, seed=3)])
def test_self_draft_accepts_everything(target, cfg):
    """A draft identical to the target (q == p exactly) is always accepted: tau = K + 1 until the last step."""
    k = 3
    stats = engine.Stats()
    out = generate(target, perturbed(target, seed=0, noise=0.0), [1, 2], cfg, k, stats=stats)
    assert len(out) == 13
    assert [s.accepted for s in stats.steps] == [k] * len(stats.steps)
    assert len(stats.steps) == math.ceil(13 / (k + 1))
    assert [t.from_draft for t in out] == [i % (k + 1) != k for i in range(13)]


class CheckingDrafter(ChainDrafter):
    """A chain drafter that checks each proposal against a fresh computation from the draft's tables."""

    def __init__(self, model: Model, k: int) -> None:
        super().__init__(model, k)
        self.proposals = 0

    def propose(self, seq, cfg, generator):
        tree = yield from super().propose(seq, cfg, generator)
        toy: ToyLM = self.model.model
        ctx = list(seq)
        for i, y in enumerate(tree.tokens.tolist()):
            want = next_distribution(toy, ctx, cfg)
            if cfg.greedy:
                assert want[y] == 1.0, "the draft cache is out of sync with the committed sequence"
            else:
                assert torch.allclose(tree.q[i].double(), want, atol=1e-6), "q is not the draft's law in context"
            ctx.append(y)
        self.proposals += 1
        return tree


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_cache_stays_in_sync(target, draft, temperature):
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=30, seed=5)
    drafter = CheckingDrafter(Model(draft), 3)
    out = list(engine.stream(Model(target), drafter, [0, 3, 1], cfg))
    assert len(out) == 30 and drafter.proposals >= 8


# ---------------------------------------------------------------- EOS and length


def test_eos_inside_accepted_run_stops(target):
    same = perturbed(target, seed=0, noise=0.0)
    ref = plain_greedy(target, PROMPT, 10)
    eos = ref[2]  # third token, inside the first step's accepted run of 4
    assert eos not in ref[:2]
    stats = engine.Stats()
    out = generate(target, same, PROMPT, SamplingConfig(max_new_tokens=10), k=4, eos=frozenset({eos}), stats=stats)
    assert [t.id for t in out] == ref[:3]
    assert all(t.from_draft for t in out)
    assert len(stats.steps) == 1 and stats.steps[0].accepted == 4  # the step had more, nothing after EOS came out
    # stop_on_eos=False ignores it
    cfg = SamplingConfig(max_new_tokens=10, stop_on_eos=False)
    assert [t.id for t in generate(target, same, PROMPT, cfg, k=4, eos=frozenset({eos}))] == ref


def test_eos_anywhere_stops_right_after_it(target, draft):
    ref = plain_greedy(target, PROMPT, 10)
    for i, eos in enumerate(ref):
        if eos not in ref[:i]:
            out = generate(target, draft, PROMPT, SamplingConfig(max_new_tokens=10), k=2, eos=frozenset({eos}))
            assert [t.id for t in out] == ref[: i + 1]


@pytest.mark.parametrize("max_new", [1, 3, 5, 7])
def test_max_new_tokens_truncates_a_step(target, max_new):
    same = perturbed(target, seed=0, noise=0.0)
    stats = engine.Stats()
    out = generate(target, same, PROMPT, SamplingConfig(max_new_tokens=max_new), k=4, stats=stats)
    assert [t.id for t in out] == plain_greedy(target, PROMPT, max_new)
    assert len(stats.steps) == math.ceil(max_new / 5)


# ---------------------------------------------------------------- exact law (chi-square goodness of fit)


def sample_counts(target: ToyLM, draft: ToyLM, cfg: SamplingConfig, m: int, seed0: int, root: bool = False
                  ) -> torch.Tensor:
    """Counts [V]*N of the first N tokens over m seeded generations (the models reused, as a server would); root:
    the root scored in the prompt's call (`root_in_prompt`)."""
    t_model, drafter = Model(target), ChainDrafter(Model(draft), 2)
    t_model.traits = replace(t_model.traits, root_in_prompt=root)
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        run = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=N,
                             seed=seed0 + i)
        toks = tuple(t.id for t in engine.stream(t_model, drafter, PROMPT, run))
        counts[toks] += 1
    return counts


LAW_CASES = {
    "T=1": (SamplingConfig(temperature=1.0), 4000, False),
    "T=0.7,top_p=0.9": (SamplingConfig(temperature=0.7, top_p=0.9), 3000, False),
    "T=1, the root scored by the prompt's call": (SamplingConfig(temperature=1.0), 4000, True),
}


@pytest.mark.parametrize("case", list(LAW_CASES))
def test_first_tokens_follow_exact_law(target, draft, case):
    cfg, m, root = LAW_CASES[case]
    law = exact_law(target, PROMPT, cfg, N)
    assert abs(float(law.sum()) - 1) < 1e-9
    pvalue, tv, floor = goodness_of_fit(sample_counts(target, draft, cfg, m, seed0=1000, root=root), law)
    assert pvalue > 1e-3, f"{case}: chi-square p-value {pvalue:.2e} (TV {tv:.4f}, noise floor {floor:.4f})"
    assert tv < 2 * floor


@pytest.mark.parametrize("root", [False, True])
def test_chi_square_detects_a_biased_verifier(target, draft, monkeypatch, root):
    """Negative control: resampling from p after a rejection (no residual) must be caught by the same harness."""
    monkeypatch.setattr(speculor.core.verify, "residual", lambda r, d: r)
    cfg = SamplingConfig(temperature=1.0)
    pvalue, tv, floor = goodness_of_fit(sample_counts(target, draft, cfg, 3000, seed0=1000, root=root),
                                        exact_law(target, PROMPT, cfg, N))
    assert pvalue < 1e-6, f"biased verifier not detected: p-value {pvalue:.2e}, TV {tv:.4f}"
