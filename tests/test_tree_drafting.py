"""Tree drafting on tiny random transformers Qwen2 models (fp32, CPU, no download): the pending-region forward of
`Model` into a `KVCache`, `TreeDrafter`'s per-depth logits against plain forwards over each node's root path (also
after commits), greedy output of `specinfer` / merged / `ngram` equal to plain greedy, and bad options."""

from __future__ import annotations

import pytest
import torch
from support.tiny import PROMPTS, reference_greedy, reference_logits
from support.tiny import draft as draft  # noqa: F401  (fixtures)
from support.tiny import pair as pair  # noqa: F401
from support.tiny import target as target  # noqa: F401
from support.toy import Watched

from speculor import Model, Pair, SamplingConfig, Speculor, SpeculorError, engine
from speculor.core.tree import expansion_shape, path_to
from speculor.drafters.merged import MergedDrafter
from speculor.drafters.ngram import NgramDrafter
from speculor.drafters.specinfer import make_specinfer
from speculor.drafters.static_tree import TreeDrafter
from speculor.engine.drafting import drive
from speculor.runtime.backend import forward1

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- Model: a tree grown one depth per forward


def test_appended_depths_equal_path_forwards(target):  # noqa: F811
    """Depth by depth into the pending region; every row equals a plain forward over its root path, also after a
    commit of a non-prefix path and a second round on the compacted cache."""
    model = Model(target)
    cache = model.new_cache()
    seq = [5, 7, 9, 11, 13, 2]
    forward1(model, cache, seq)
    cache.keep(list(range(len(seq))))
    for _ in range(2):
        # depth 1: region rows 0, 1, 2 (two of them the same token); depth 2: rows 3..5; depth 3: row 6
        blocks = [([20, 21, 20], [-1, -1, -1]), ([30, 31, 32], [0, 0, 2]), ([40], [5])]
        region_tokens, region_parents = [], []
        for tokens, parents in blocks:
            logits = forward1(model, cache, tokens, torch.tensor(parents), append=True).logits
            region_tokens += tokens
            region_parents += parents
            base = len(region_tokens) - len(tokens)
            for i in range(len(tokens)):
                path = [region_tokens[j] for j in path_to(torch.tensor(region_parents), base + i)]
                diff = (logits[i] - reference_logits(target, seq + path)).abs().max()
                assert diff < 1e-4, f"row {base + i} (path {path}): max abs diff {diff:.2e}"
        assert cache.length == len(seq) and len(cache.pending) == 7
        cache.keep([2, 5, 6])  # keep the path 20 -> 32 -> 40 (rows 2, 5, 6)
        seq = seq + [20, 32, 40]
        assert cache.length == len(seq) == cache.get_seq_length() and len(cache.pending) == 0
    assert (forward1(model, cache, [3]).logits[0] - reference_logits(target, seq + [3])).abs().max() < 1e-4


def test_plain_forward_drops_the_pending_region(target):  # noqa: F811
    model = Model(target)
    cache = model.new_cache()
    forward1(model, cache, [3, 4, 5])
    cache.keep([0, 1, 2])
    forward1(model, cache, [6, 7], append=True)
    forward1(model, cache, [8], append=True)  # parents=None with append: continues the last pending entry
    assert len(cache.pending) == 3 and cache.pending.tolist() == [-1, 0, 1]
    logits = forward1(model, cache, [9]).logits  # append=False: a fresh block after the committed cache
    assert len(cache.pending) == 1 and (logits[0] - reference_logits(target, [3, 4, 5, 9])).abs().max() < 1e-4
    cache.trim(2)
    assert cache.length == 2 and len(cache.pending) == 0


# ---------------------------------------------------------------- TreeDrafter


class Checked(Watched):
    """Checks every proposal of a TreeDrafter: its q rows against plain forwards of the draft over each parent's
    root path (T = 1, so log q = log_softmax(logits)), and one draft forward per depth."""

    def __init__(self, inner: TreeDrafter, draft) -> None:  # noqa: F811
        super().__init__(inner)
        self.draft = draft

    def seen(self, seq, cfg, tree) -> None:
        assert self.inner.forwards == len(self.inner.levels)  # one draft forward per depth
        for i in range(len(tree)):
            above = [int(tree.tokens[j]) for j in path_to(tree.parents, int(tree.parents[i]))]
            want = torch.log_softmax(reference_logits(self.draft, list(seq) + above), -1)
            diff = (torch.log(tree.q[i]) - want).abs().max()
            assert diff < 1e-4, f"node {i}: max abs diff of log q {diff:.2e}"
            assert tree.q[i, tree.tokens[i]] > 0


@pytest.mark.parametrize("draw", ["iid", "swor"])
def test_tree_drafter_logits_equal_path_forwards(target, draft, draw):  # noqa: F811
    shape = expansion_shape([2, 2, 1])
    drafter = Checked(TreeDrafter(Model(draft), shape, draw), draft)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=1)
    stats = engine.Stats()
    out = list(engine.stream(Model(target), drafter, PROMPTS[0], cfg, stats=stats))
    assert len(out) == 24 and drafter.proposals == len(stats.steps) >= 4
    assert any(s.accepted >= 2 for s in stats.steps)  # commits of accepted paths happened between proposals


def test_tree_drafter_siblings(draft):  # noqa: F811
    model = Model(draft)
    g = torch.Generator().manual_seed(0)
    greedy = drive(TreeDrafter(model, [-1, -1, -1, 0, 0]).propose([1, 2, 3], SamplingConfig(), g))
    top = torch.topk(reference_logits(draft, [1, 2, 3]), 3).indices.tolist()
    assert greedy.tokens[:3].tolist() == top and greedy.draw == "point" and greedy.q is None
    assert len(set(greedy.tokens[3:].tolist())) == 2
    # SWOR: distinct siblings; with top_k = 2 the support has 2 tokens, so the third root child and its
    # subtree are left out
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    swor = drive(TreeDrafter(model, [-1, -1, -1, 2, 0, 1, 1], "swor").propose([1, 2, 3], cfg, g))
    assert swor.parents.tolist() == [-1, -1, 0, 1, 1] and swor.draw == "swor"
    assert len(set(swor.tokens[:2].tolist())) == 2 and set(swor.tokens[:2].tolist()) == set(top[:2])
    assert swor.tokens[3] != swor.tokens[4]


def test_tree_drafter_refuses_bad_arguments(draft):  # noqa: F811
    for kwargs in ({"draw": "point"}, {"temperature": 0}, {"temperature": "hot"}):
        with pytest.raises(SpeculorError):
            TreeDrafter(Model(draft), [-1, 0], **kwargs)
    for shape in ([], [0], [-1, 2, 0]):
        with pytest.raises(SpeculorError):
            TreeDrafter(Model(draft), shape)


# ---------------------------------------------------------------- greedy output equals plain greedy


def strategies(draft_model: Model) -> dict[str, object]:
    return {  # every drafter, the two merged ones included, has its own cache on the one shared model
        "paper": TreeDrafter(draft_model, expansion_shape([1, 1, 3, 1, 1, 1, 1, 1])),
        "wide": TreeDrafter(draft_model, expansion_shape([3, 2, 1]), "swor"),
        "merged": MergedDrafter([TreeDrafter(draft_model, expansion_shape([2, 1])),
                                 TreeDrafter(draft_model, expansion_shape([1, 2]), temperature=1.5),
                                 NgramDrafter(3)]),
        "ngram": NgramDrafter(4, branches=2),
    }


@pytest.mark.parametrize("name", ["paper", "wide", "merged", "ngram"])
def test_greedy_equals_plain_greedy(target, draft, name):  # noqa: F811
    t_model = Model(target)
    drafter = strategies(Model(draft))[name]
    cfg = SamplingConfig(max_new_tokens=20)
    for prompt in PROMPTS:
        stats = engine.Stats()
        spec = [t.id for t in engine.stream(t_model, drafter, prompt, cfg, stats=stats)]
        assert spec == reference_greedy(target, prompt, 20), f"prompt {prompt}"
        assert stats.tau >= 1


def test_self_draft_tree_accepts_a_full_path(target):  # noqa: F811
    stats = engine.Stats()
    model = Model(target)
    drafter = TreeDrafter(model, expansion_shape([2, 1, 1]))  # the same model (own cache): every path is greedy
    out = list(engine.stream(model, drafter, PROMPTS[0], SamplingConfig(max_new_tokens=16), stats=stats))
    assert [t.id for t in out] == reference_greedy(target, PROMPTS[0], 16)
    assert [s.accepted for s in stats.steps] == [3] * 4 and [s.draft_forwards for s in stats.steps] == [3] * 4


# ---------------------------------------------------------------- strategies and their options


@pytest.mark.parametrize("options", [{}, {"expansion": "2-1-1"}, {"expansion": (2, 2)}, {"expansion": 3},
                                     {"drafters": "draft+draft@1.5+ngram"}, {"drafters": "ngram,draft"},
                                     {"drafters": ["draft", NgramDrafter(2)], "expansion": "1,2"}])
def test_specinfer_strategy_greedy(pair, target, options):  # noqa: F811
    sp = Speculor(pair, strategy="specinfer", **options)
    out = sp.generate(PROMPTS[3], SamplingConfig(max_new_tokens=12, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, PROMPTS[3], 12)


def test_specinfer_builds_what_it_says(pair):  # noqa: F811
    paper = make_specinfer(pair).drafter()
    assert isinstance(paper, TreeDrafter) and paper.shape == expansion_shape([1, 1, 3, 1, 1, 1, 1, 1])
    merged = make_specinfer(pair, expansion="2-1", drafters="draft+draft@0.5+ngram").drafter()
    assert isinstance(merged, MergedDrafter)
    a, b, c = merged.drafters
    assert a.model is pair.draft and b.model is pair.draft and a.cache is not b.cache  # own cache
    assert (a.temperature, b.temperature) == (None, 0.5) and isinstance(c, NgramDrafter) and c.k == 2


def test_ngram_strategy(pair, target):  # noqa: F811
    sp = Speculor(pair, strategy="ngram", k=3, n=2, branches=2)
    stats = engine.Stats()
    ids = list(sp.tokens(PROMPTS[2], SamplingConfig(max_new_tokens=12, stop_on_eos=False), stats=stats))
    assert [t.id for t in ids] == reference_greedy(target, PROMPTS[2], 12)
    assert all(s.draft_forwards == 0 for s in stats.steps) and stats.steps[0].drafted >= 3
    Speculor(Pair(pair.target, None, pair.tokenizer), strategy="ngram")  # needs no draft model


@pytest.mark.parametrize(("name", "options"), [
    ("specinfer", {"expansion": "0"}), ("specinfer", {"expansion": "1-a"}), ("specinfer", {"expansion": (1, 0)}),
    ("specinfer", {"expansion": "8-8-8-8"}), ("specinfer", {"expansion": ""}), ("specinfer", {"expansion": True}),
    ("specinfer", {"expansion": 2.5}), ("specinfer", {"drafters": "foo"}), ("specinfer", {"drafters": "draft@-1"}),
    ("specinfer", {"drafters": "ngram@2"}), ("specinfer", {"drafters": []}), ("specinfer", {"drafters": [3]}),
    ("specinfer", {"depth": 3}), ("ngram", {"k": 0}), ("ngram", {"n": 0}), ("ngram", {"branches": "x"}),
    ("ngram", {"k": 65}), ("ngram", {"budget": 3}),
])
def test_bad_options(pair, name, options):  # noqa: F811
    with pytest.raises(SpeculorError):
        Speculor(pair, strategy=name, **options)


def test_specinfer_needs_a_draft_model(pair):  # noqa: F811
    no_draft = Pair(pair.target, None, pair.tokenizer)
    with pytest.raises(SpeculorError, match="needs a draft"):
        Speculor(no_draft, strategy="specinfer")
    Speculor(no_draft, strategy="specinfer", drafters="ngram")  # model-free: fine
