"""The heads on the target's features (runtime/eagle_head.py, drafters/heads.py) and their strategies on the toy LMs:
a head row depends on its own inputs alone, the engine hands the drafter the target's own features, greedy output is
plain greedy alone and in a batch, and the law of `eagle` (DySpec's tree from one head) and of the boosted pool
(SpecInfer's merged trees, mixed q's) is the target's: exact enumeration of the merged nodes and chi-square through
the engine at T = 1 and at T = 0.7 / top-p 0.9, with a negative control that the same harness catches.

The toy target's hidden state at a position is the one-hot of its input token (tests/support/toy.py), so a head over
it sees (x_{t-1}, x_t): what the toy's second-order law depends on."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from support.batch import run_batch
from support.exact import EXACT, Tables, as_tensor, l1, real_law, source_outcomes, target_law, tree_p
from support.stats import goodness_of_fit
from support.toy import T1, N, V, exact_law, plain_greedy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.tree import DraftTree, expansion_shape, merge, path_to
from speculor.drafters.dynamic_tree import DySpecOptions
from speculor.drafters.eagle import EagleDrafter
from speculor.drafters.heads import BoostedDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.errors import SpeculorError
from speculor.runtime.backend import Block, Rows
from speculor.runtime.eagle_head import EagleConfig, EagleHead, FeatureStore, HeadModel, load_pool, save_pool
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")

TOP_P = SamplingConfig(temperature=0.7, top_p=0.9)


def one_hot(ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, V).float()


def random_head(seed: int, v: int = V, vocab: int | None = None, scale: float = 1.0) -> EagleHead:
    torch.manual_seed(seed)
    vocab = vocab or v
    head = EagleHead(EagleConfig(v, width=16, ffn=24, blocks=1, vocab=vocab), torch.arange(vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn_like(p))  # away from the init: distinct heads
    return head.eval()


def head_model(seed: int, vocab: int | None = None) -> HeadModel:
    return HeadModel(random_head(seed, vocab=vocab), one_hot, vocab_size=V, context_length=4096)


def eagle(seed: int = 0, **options) -> EagleDrafter:
    return EagleDrafter(head_model(seed), DySpecOptions("threshold", **{"budget": 4, "depth": 3, **options}), None)


def boosted(seeds=(0, 1, 2), shape=(1, 1)) -> BoostedDrafter:
    store = FeatureStore()
    return BoostedDrafter([TreeDrafter(head_model(s).bind(store), expansion_shape(list(shape)), "iid")
                           for s in seeds], store)


# ---------------------------------------------------------------- the head as a backend


def test_rows_depend_on_their_own_inputs_alone():
    """A tree block's rows, computed in waves and batched with another request's, equal each row computed alone
    from its parent's feature (the target's where the store has it, else the parent row's prediction)."""
    hm = head_model(3)
    store = FeatureStore()
    store.put(4, torch.randn(2, V))  # the target's features of positions 4 and 5
    view = hm.bind(store)
    cache = view.new_cache()
    cache.length = 6  # committed: positions 0..5; the tree hangs below position 5
    tokens, parents = [1, 2, 3, 4], torch.tensor([-1, 0, 0, 1])
    other = hm.bind(FeatureStore())
    other_cache = other.new_cache()
    logits = hm.forward([Block(cache, tokens, parents), Block(other_cache, [5, 0])])[0].logits
    head = hm.head
    s5 = head.standardize(store.get(5)[None])
    s_root, l_root = head(s5, one_hot(torch.tensor([1])))
    s_a, l_a = head(s_root, one_hot(torch.tensor([2])))
    _, l_b = head(s_root, one_hot(torch.tensor([3])))
    _, l_c = head(s_a, one_hot(torch.tensor([4])))
    want = torch.cat([l_root, l_a, l_b, l_c])
    assert torch.allclose(logits, want, atol=1e-5)
    with pytest.raises(SpeculorError, match="caches its own views"):
        hm.forward([Block(object(), [1])])


def test_head_law_is_a_distribution_on_its_ids():
    hm = head_model(4, vocab=4)  # ids 0..3 of a vocabulary of 6: tokens 4, 5 never drafted
    cache = hm.bind(FeatureStore()).new_cache()
    logits = hm.forward([Block(cache, [2, 3, 1])])[0].logits
    assert logits.shape == (3, V)
    assert torch.isinf(logits[:, 4:]).all() and torch.isfinite(logits[:, :4]).all()
    last = hm.forward([Block(hm.bind(FeatureStore()).new_cache(), [2, 3, 1], last=True)])[0].logits
    assert torch.allclose(last, logits[-1:], atol=1e-6)


def test_cache_keeps_a_path_and_forgets_the_rest():
    hm = head_model(5)
    store = FeatureStore()
    cache = hm.bind(store).new_cache()
    hm.forward([Block(cache, [1])])
    cache.keep([0])
    hm.forward([Block(cache, [2, 3, 4], torch.tensor([-1, 0, -1]))])
    predicted = cache.s[1].clone()
    cache.keep([0, 1])
    assert cache.length == 3 and cache.parents == [] and torch.equal(cache.tip, predicted)
    cache.trim(2)
    assert cache.length == 2 and cache.tip is None
    with pytest.raises(SpeculorError, match="no feature to start from"):
        hm.forward([Block(cache, [1])])  # position 1's feature: neither the target's nor a prediction
    store.put(1, torch.zeros(1, V))
    hm.forward([Block(cache, [1])])


def test_pool_saves_and_loads(tmp_path):
    heads = [random_head(s) for s in (0, 1)]
    save_pool(heads, tmp_path / "pool", {"what": "test"})
    loaded, manifest = load_pool(tmp_path / "pool")
    assert manifest["ssms"] == 2 and manifest["what"] == "test"
    x, e = torch.randn(3, V), torch.randn(3, V)
    for a, b in zip(heads, loaded, strict=True):
        assert torch.allclose(a(x, e)[1], b(x, e)[1], atol=5e-2)  # fp16 weights
    (tmp_path / "pool" / "ssm2.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(SpeculorError, match="cannot load a pool"):
        load_pool(tmp_path / "pool")


# ---------------------------------------------------------------- through the engine


def test_the_drafter_reads_the_targets_own_features(target):
    """After decoding, the store holds the target's hidden state (the toy's: one-hot of the input token) of every
    recent committed position: the verify forwards' root and accepted rows, and the prompt's last."""
    drafter = eagle(1)
    prompt = [3, 1, 4, 1]
    out = [t.id for t in engine.stream(Model(target), drafter, prompt, replace(T1, max_new_tokens=12, seed=3))]
    seq = prompt + out
    assert drafter.store.f, "no feature reached the drafter"
    for pos, f in drafter.store.f.items():
        assert torch.equal(f, one_hot(torch.tensor(seq[pos]))), f"position {pos}"
    # the last emitted token is seen only if an accepted draft row emitted it (a bonus token is the next root)
    assert max(drafter.store.f) >= len(seq) - 2 and max(drafter.store.f) < len(seq)


def test_the_prefill_gives_the_feature_of_its_last_position(target):
    """The prompt's prefill (every token but the root) hands over its rows' features at their positions, also where
    a backend gives only the last row's (llama.cpp: `last` computes only the wanted rows; at position 0 it made the
    head walk the whole prompt to the root)."""
    from speculor.engine.loop import start

    prompt = [3, 1, 4, 1, 5]
    for last_only in (False, True):
        model, drafter = Model(target), eagle(1)
        if last_only:
            model.forward = lambda blocks, full=model.forward, **kw: [
                Rows(o.logits, o.hidden[-1:]) if o.hidden is not None else o for o in full(blocks, **kw)]
        start(model, drafter, prompt, SamplingConfig(max_new_tokens=4))
        assert max(drafter.store.f) == len(prompt) - 2
        for pos, f in drafter.store.f.items():
            assert torch.equal(f, one_hot(torch.tensor(prompt[pos]))), (last_only, pos)


@pytest.mark.parametrize("make", [lambda: eagle(0), lambda: eagle(2, depth=5), lambda: boosted()])
@pytest.mark.parametrize("prompt", [[1, 2], [5], [0, 3, 3, 1, 2]])
def test_greedy_is_plain_greedy(target, make, prompt):
    out = [t.id for t in engine.stream(Model(target), make(), prompt, SamplingConfig(max_new_tokens=16))]
    assert out == plain_greedy(target, prompt, 16)


def test_greedy_in_a_batch_is_greedy_alone(target):
    prompts = [[1, 2], [5, 0, 1], [2, 2, 2, 3], [4]]
    cfg = SamplingConfig(max_new_tokens=12)
    makers = [lambda: eagle(0), boosted, lambda: eagle(1), lambda: None]
    out = run_batch(Model(target), makers, prompts, [cfg] * 4)
    assert out == [plain_greedy(target, p, 12) for p in prompts]


def law_counts(target, make, prompt, cfg, m, seed0):
    t_model, drafter = Model(target), make()
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        run = replace(cfg, max_new_tokens=N, seed=seed0 + i)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, prompt, run))] += 1
    return counts


@pytest.mark.parametrize("cfg", [T1, TOP_P], ids=["T1", "T0.7-top-p0.9"])
@pytest.mark.parametrize("name", ["eagle", "boosted"])
def test_strategies_follow_the_exact_law(target, name, cfg):
    make = {"eagle": lambda: eagle(0, budget=5), "boosted": boosted}[name]
    prompt = [2, 1, 2]
    c = law_counts(target, make, prompt, cfg, 1500, 300)
    pvalue, tv, floor = goodness_of_fit(c, exact_law(target, prompt, cfg, N))
    assert pvalue > 1e-3, f"{name}: chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"{name}: TV {tv:.4f} vs noise floor {floor:.4f}"


class BoostedWithoutGroups(BoostedDrafter):
    """Negative control: the merged tree verified as if one drafter had drawn every child i.i.d. from the first
    SSM's q (the other SSMs' q's dropped): biased."""

    def propose(self, seq, cfg, generator):
        tree = yield from super().propose(seq, cfg, generator)
        if tree.q is None or not len(tree):
            return tree
        q = tree.q[0].expand(len(tree), -1).clone()
        return DraftTree(tree.tokens, tree.parents, q, "iid")


def test_chi_square_catches_a_pool_verified_with_one_q(target):
    prompt = [2, 1, 2]
    law = exact_law(target, prompt, T1, N)

    def make():
        store = FeatureStore()
        return BoostedWithoutGroups([TreeDrafter(head_model(s).bind(store), expansion_shape([2]), "iid")
                                     for s in (0, 7)], store)

    pvalue, tv, _ = goodness_of_fit(law_counts(target, make, prompt, T1, 1500, 900), law)
    assert pvalue < 1e-6, f"a pool verified with one q was not caught: p-value {pvalue:.2e}, TV {tv:.4f}"


# ---------------------------------------------------------------- exact enumeration of the pool's merged nodes


def head_tables(head: EagleHead, v: int, f0: torch.Tensor, root: int) -> dict[tuple[int, ...], torch.Tensor]:
    """q(.|ctx) of a head for every context of up to 2 draft tokens below `root` (feature recurrence), fp64."""
    out = {}
    with torch.no_grad():
        s_root, l_root = head(head.standardize(f0[None]), torch.eye(v)[[root]])
        out[()] = l_root[0].double().softmax(-1)
        for x in range(v):
            s_x, l_x = head(s_root, torch.eye(v)[[x]])
            out[(x,)] = l_x[0].double().softmax(-1)
            for y in range(v):
                _, l_y = head(s_x, torch.eye(v)[[y]])
                out[(x, y)] = l_y[0].double().softmax(-1)
    return out


def pool_law(t: Tables, sources, n: int, one_q: bool = False) -> torch.Tensor:
    """Law of the first n tokens of one step verifying the merge of the sources' trees, every draft outcome
    enumerated; one_q: every node verified as if SSM 1 had drawn it (its q at the node's context: biased)."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for combo in itertools.product(*(list(source_outcomes(*src)) for src in sources)):
        tree = merge([tr for tr, _ in combo]).tree
        if one_q:
            ctx = [tuple(int(tree.tokens[j]) for j in path_to(tree.parents, i))[:-1] for i in range(len(tree))]
            tree = DraftTree(tree.tokens, tree.parents, torch.stack([sources[0][0][c] for c in ctx]), "iid")
        for out, prob in real_law(tree, tree_p(t, tree)).items():
            law[out] += math.prod(w for _, w in combo) * prob
    return as_tensor(law, t, n)


@pytest.mark.parametrize("seed", [0, 1])
def test_merged_pool_nodes_are_exact(seed):
    """Three heads' trees (each SSM its own q at every node: the pool's mixed q's) merged by prefix and verified,
    every draft outcome enumerated: the law of the first tokens is p's; verified with one SSM's q it is not."""
    v = 3
    t = Tables("random", v, seed=400 + seed)
    f0 = torch.randn(v, generator=torch.Generator().manual_seed(seed))
    heads = [random_head(10 * seed + k, v=v, scale=0.3) for k in range(3)]
    sources = [(head_tables(h, v, f0, root=1), ks, "iid") for h, ks in zip(heads, [(2, 1), (1, 1), (1, 1)],
                                                                           strict=True)]
    assert not any(torch.allclose(a[0][()], b[0][()], atol=0.05) for a, b in itertools.combinations(sources, 2))
    assert l1(pool_law(t, sources, 3), target_law(t, 3)) < EXACT
    assert l1(pool_law(t, sources, 3, one_q=True), target_law(t, 3)) > 1e-3


def test_a_seed_gives_the_same_sample_alone_and_in_a_batch(target):
    prompts = [[1, 2], [5, 0, 1], [2, 2, 2, 3]]
    cfgs = [replace(TOP_P, max_new_tokens=10, seed=s) for s in (11, 12, 13)]
    makers = [lambda: eagle(0), boosted, lambda: eagle(1)]
    together = run_batch(Model(target), makers, prompts, cfgs)
    alone = [[t.id for t in engine.stream(Model(target), m(), p, c)] for m, p, c in zip(makers, prompts, cfgs,
                                                                                          strict=True)]
    assert together == alone


# ---------------------------------------------------------------- a pool for another target


def test_a_pool_for_another_target_is_refused(tmp_path):
    from support.tiny import near_pair

    from speculor.drafters.registry import make_strategy

    pair = near_pair("tiny-target", "tiny-draft")
    with pytest.raises(SpeculorError, match="trained for qwen2.5-coder-1.5b-instruct"):
        make_strategy("eagle", pair)
    with pytest.raises(SpeculorError, match="trained for qwen2.5-coder-1.5b-instruct"):
        make_strategy("specinfer", pair, drafters="boosted")
    with pytest.raises(SpeculorError, match="cannot load a pool"):
        make_strategy("eagle", pair, heads=str(tmp_path / "nothing"))
    save_pool([random_head(0)], tmp_path / "v6", {})  # features of size 6: not the tiny target's
    with pytest.raises(SpeculorError, match="read features of size 6"):
        make_strategy("eagle", pair, budget=4, heads=str(tmp_path / "v6"))
    with pytest.raises(SpeculorError, match="heads option is for drafters=boosted"):
        make_strategy("specinfer", pair, heads=str(tmp_path / "v6"))
    size = pair.target.model.config.hidden_size
    head = EagleHead(EagleConfig(size, width=8, ffn=8, blocks=1, vocab=5), torch.arange(5))
    save_pool([head], tmp_path / "fits", {})
    out = [t.id for t in engine.stream(pair.target, make_strategy("eagle", pair, budget=3, heads=str(tmp_path / "fits"))
                                       .drafter(), [1, 2, 3], SamplingConfig(max_new_tokens=8))]
    plain = [t.id for t in engine.stream(pair.target, None, [1, 2, 3], SamplingConfig(max_new_tokens=8))]
    assert out == plain


def test_a_pool_is_held_by_its_target(tmp_path):
    """The pool is loaded once per target and held by that model (drafters/heads.py): the same heads for the same
    target, its own for another model, and nothing left once a target is gone (an id() key could hand a new model
    the pool of a collected one)."""
    import gc

    from support.tiny import near_pair

    from speculor.drafters import heads
    from speculor.runtime.backend import Pair

    pair = near_pair("tiny-target", "tiny-draft")
    cfg = EagleConfig(pair.target.hidden_size, width=8, ffn=8, blocks=1, vocab=5)
    save_pool([EagleHead(cfg, torch.arange(5))], tmp_path, {})
    first = heads.pool(pair, str(tmp_path))
    assert heads.pool(Pair(pair.target, None, pair.tokenizer), str(tmp_path)) is first
    other = Model(pair.target.model)
    assert heads.pool(Pair(other, None, pair.tokenizer), str(tmp_path)) is not first
    held = len(heads._POOLS)
    del pair, first, other
    gc.collect()
    assert len(heads._POOLS) == held - 2


def test_every_backend_has_every_member_of_the_protocol(target):
    """What callers read off a backend is declared on `Backend` (runtime/backend.py), and the torch model and a
    head (and a request's view of it) have all of it; their caches have all of `Cache`."""
    from speculor.runtime.backend import Backend, Cache

    members = [m for m in (*Backend.__annotations__, *vars(Backend)) if not m.startswith("_")]
    hm = head_model(0)
    for backend in (Model(target), hm, hm.bind(FeatureStore())):
        assert backend.shared in (backend, hm)
        assert all(hasattr(backend, m) for m in members), [m for m in members if not hasattr(backend, m)]
        cache = backend.new_cache()
        assert all(hasattr(cache, m) for m in ("length", "pending", "keep", "trim")), type(cache)
        assert set(Cache.__annotations__) | {"pending", "keep", "trim"} <= set(dir(cache))
