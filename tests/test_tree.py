"""Token trees (speculor.core.tree, pure functions): depths, ancestors, the 4-D tree attention mask, depth-based
positions, paths, block indices and `DraftTree`; static tree shapes (expansion, paths, chain); `tree.merge`, nested
merges included (their draw groups, and exact verification of a nested merge); prompt lookup (`ngram_continuations`);
and the child samplers (i.i.d., without replacement, top tokens)."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict

import pytest
import torch
from scipy.stats import chisquare
from support.exact import EXACT, Tables, as_tensor, l1, real_law, source_outcomes, target_law, tree_p

from speculor.core.sampling import draw_iid, draw_swor, top_tokens
from speculor.core.tree import (
    DraftTree,
    ancestors,
    attention_mask,
    block_parents,
    chain_shape,
    check_shape,
    depths,
    expansion_shape,
    merge,
    path_to,
    paths_shape,
    position_ids,
    shape_levels,
)
from speculor.core.verify import verify_sampled
from speculor.drafters.lookup import NgramIndex, ngram_continuations
from speculor.errors import SpeculorError

# ---------------------------------------------------------------- tree structure: depths, masks, positions, DraftTree

#        root
#       /    \       \
#      0      1       7
#     / \     |
#    2   3    4
#    |        |
#    5        6
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4, -1])
DEPTHS = [0, 0, 1, 1, 1, 2, 2, 0]
PATHS = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5], 6: [1, 4, 6], 7: [7]}


def test_depths():
    assert depths(PARENTS).tolist() == DEPTHS
    assert depths(torch.arange(-1, 4)).tolist() == [0, 1, 2, 3, 4]
    assert depths(torch.zeros(0, dtype=torch.long)).tolist() == []


def test_path_to():
    for node, path in PATHS.items():
        assert path_to(PARENTS, node) == path
    assert path_to(PARENTS, -1) == []


def test_ancestors_match_paths():
    a = ancestors(PARENTS)
    assert a.dtype == torch.bool and a.shape == (8, 8)
    for i in range(8):
        assert set(torch.nonzero(a[i]).flatten().tolist()) == set(PATHS[i])


@pytest.mark.parametrize("past", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_mask(past, dtype):
    mask = attention_mask(PARENTS, past, dtype)
    n = len(PARENTS)
    assert mask.shape == (1, 1, n, past + n) and mask.dtype == dtype
    lo = torch.finfo(dtype).min
    assert set(mask.unique().tolist()) <= {0.0, lo}
    m = mask[0, 0]
    assert (m[:, :past] == 0).all(), "every row sees the whole cached prefix"
    for i in range(n):
        seen = {j - past for j in range(past, past + n) if m[i, j] == 0}
        assert seen == set(PATHS[i]), f"row {i} must see exactly its ancestors and itself"


def test_attention_mask_of_a_chain_is_causal():
    m = attention_mask(torch.arange(-1, 4), 2, torch.float32)[0, 0]
    assert torch.equal(m == 0, torch.ones(5, 7, dtype=torch.bool).tril(2))


def test_attention_mask_of_a_block_with_root():
    """[root] + nodes: the root sees only itself in the block, every node also sees the root."""
    bp = block_parents(PARENTS)
    m = attention_mask(bp, 4, torch.float32)[0, 0]
    assert (m[:, 4] == 0).all()
    assert (m[0, 5:] != 0).all()
    for i in range(8):
        seen = {j - 5 for j in range(5, 13) if m[i + 1, j] == 0}
        assert seen == set(PATHS[i])


@pytest.mark.parametrize("past", [0, 1, 17])
def test_position_ids_are_past_plus_depth(past):
    pos = position_ids(PARENTS, past)
    assert pos.shape == (1, 8) and pos.dtype == torch.long
    assert pos[0].tolist() == [past + d for d in DEPTHS]
    assert pos[0].tolist() != list(range(past, past + 8)), "positions are depths, never the flat index"
    bp = position_ids(block_parents(PARENTS), past)[0].tolist()
    assert bp == [past] + [past + 1 + d for d in DEPTHS]


def test_block_parents():
    assert block_parents(PARENTS).tolist() == [-1, 0, 0, 1, 1, 2, 3, 5, 0]
    assert block_parents(torch.zeros(0, dtype=torch.long)).tolist() == [-1]
    for i, path in PATHS.items():  # node i is block row i + 1, under the root (row 0)
        assert path_to(block_parents(PARENTS), i + 1) == [0] + [j + 1 for j in path]


def test_chain():
    q = torch.full((3, 5), 0.2)
    tree = DraftTree.chain([4, 1, 3], q)
    assert tree.tokens.tolist() == [4, 1, 3] and tree.tokens.dtype == torch.long
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.q is q and tree.draw == "iid" and len(tree) == 3
    assert tree.children(-1) == [0] and tree.children(0) == [1] and tree.children(2) == []
    assert DraftTree.chain([2], draw="point").q is None


def test_children_in_draw_order():
    tree = DraftTree(torch.arange(8), PARENTS)
    assert tree.children(-1) == [0, 1, 7]
    assert tree.children(0) == [2, 3]
    assert tree.children(4) == [6]
    assert tree.children(5) == []


def test_empty_tree():
    tree = DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert len(tree) == 0 and tree.children(-1) == []


@pytest.mark.parametrize(("tokens", "parents", "q"), [
    ([1, 2], [-1, 1], None),  # a node is its own parent
    ([1, 2], [1, -1], None),  # a parent after its child
    ([1, 2, 3], [-1, 0], None),  # lengths differ
    ([1, 2], [-1, 0], torch.ones(3, 4) / 4),  # one q row per node
])
def test_bad_trees_are_refused(tokens, parents, q):
    with pytest.raises((AssertionError, RuntimeError)):
        DraftTree(torch.tensor(tokens), torch.tensor(parents), q)


# ---------------------------------------------------------------- shapes


def test_expansion_shape_by_hand():
    assert expansion_shape([1]) == [-1]
    assert expansion_shape([3]) == [-1, -1, -1]
    #  root -> 0, 1;  0 -> 2, 3, 4;  1 -> 5, 6, 7
    assert expansion_shape([2, 3]) == [-1, -1, 0, 0, 0, 1, 1, 1]
    # SpecInfer's <1,1,3,1,...>: a chain of two, three branches, each continued as a chain
    assert expansion_shape([1, 1, 3, 1, 1]) == [-1, 0, 1, 1, 1, 2, 3, 4, 5, 6, 7]
    paper = expansion_shape([1, 1, 3, 1, 1, 1, 1, 1])
    assert len(paper) == 20 and [len(level) for level in shape_levels(paper)] == [1, 1, 3, 3, 3, 3, 3, 3]


def test_chain_shape():
    assert chain_shape(0) == [] and chain_shape(1) == [-1] and chain_shape(4) == [-1, 0, 1, 2]
    assert chain_shape(5) == expansion_shape([1] * 5) == paths_shape([(0,) * i for i in range(1, 6)])


def test_paths_shape_by_hand():
    # Medusa / vLLM choice format, listed in any order
    paths = [(0, 1), (1,), (0,), (0, 0), (1, 0), (0, 0, 0), (2,)]
    #  nodes: 0=(0,) 1=(1,) 2=(2,) 3=(0,0) 4=(0,1) 5=(1,0) 6=(0,0,0)
    assert paths_shape(paths) == [-1, -1, -1, 0, 0, 1, 3]
    assert paths_shape([(0,), (0,)]) == [-1]
    assert paths_shape([(0,), (1,), (0, 0), (0, 1)]) == expansion_shape([2, 1])[:3] + [0]


@pytest.mark.parametrize("paths", [[], [()], [(0, 0)], [(0,), (2,)], [(0,), (0, 1)], [(-1,)], [(0,), ("a",)]])
def test_bad_paths(paths):
    with pytest.raises(SpeculorError):
        paths_shape(paths)


@pytest.mark.parametrize("ks", [[], [0], [2, -1], [1.5], [True]])
def test_bad_expansion(ks):
    with pytest.raises(SpeculorError):
        expansion_shape(ks)


def test_check_shape_and_levels():
    assert check_shape((-1, 0, 0)) == [-1, 0, 0]
    for bad in ([], [0], [-1, 1], [-2], [-1, 0.5]):
        with pytest.raises(SpeculorError):
            check_shape(bad)
    # a shape need not list nodes depth by depth: levels still group them
    assert shape_levels([-1, 0, -1, 1, 2]) == [[0, 2], [1, 4], [3]]


# ---------------------------------------------------------------- merge


def make_tree(tokens, parents, q=None, draw="iid") -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), q, draw)


def q_rows(n: int, v: int = 8) -> torch.Tensor:
    return torch.full((n, v), 1.0 / v)


def paths_of(t: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(int(t.tokens[j]) for j in path_to(t.parents, i)) for i in range(len(t))}


def test_merge_of_point_chains_is_a_trie():
    a, b = DraftTree.chain([1, 2, 3], draw="point"), DraftTree.chain([1, 2, 4], draw="point")
    c = DraftTree.chain([5], draw="point")
    m = merge([a, b, c])
    assert m.tree.tokens.tolist() == [1, 5, 2, 3, 4] and m.tree.parents.tolist() == [-1, -1, 0, 2, 2]
    assert m.tree.q is None and m.tree.draw == "point" and m.tree.kinds is None
    assert paths_of(m.tree) == paths_of(a) | paths_of(b) | paths_of(c)  # exactly the union of the sequences
    assert m.sub_path(0, [0, 2, 3]) == [0, 1, 2] and m.sub_path(1, [0, 2, 4]) == [0, 1, 2]
    assert m.sub_path(1, [0, 2, 3]) == [0, 1] and m.sub_path(2, [0, 2]) == [] and m.sub_path(2, [1]) == [0]


def test_merge_keeps_sampled_duplicates_as_ghost_leaves():
    # source 0: iid root children 7, 7 (a repeat), each with one child; source 1: root child 7 with child 9
    a = make_tree([7, 7, 1, 2], [-1, -1, 0, 1], q_rows(4))
    b = make_tree([7, 9], [-1, 0], q_rows(2), "swor")
    m = merge([a, b])
    t = m.tree
    # root children in draw order: a's 7 (real), a's 7 (ghost), b's 7 (ghost); then 7's children 1, 2, 9
    assert t.tokens.tolist() == [7, 7, 7, 1, 2, 9]
    assert t.parents.tolist() == [-1, -1, -1, 0, 0, 0]
    assert t.kinds == ("iid", "iid", "swor", "iid", "iid", "swor")
    assert t.children(1) == [] and t.children(2) == []  # ghosts are leaves
    g = t.groups.tolist()
    assert g[0] == g[1] != g[2] and len({g[3], g[4], g[5]}) == 3  # one draw sequence per source node
    assert m.origins[0][:3] == [0, -1, -1] and m.origins[1][:3] == [0, -1, -1]
    assert m.sub_path(0, [0, 4]) == [0, 3] and m.sub_path(1, [0, 5]) == [0, 1] and m.sub_path(1, [0, 3]) == [0]
    assert torch.equal(t.q[2], b.q[0]) and torch.equal(t.q[5], b.q[1])


def test_merge_mixes_point_and_sampled_children():
    sampled = make_tree([3, 4], [-1, -1], q_rows(2))
    point = DraftTree.chain([4, 5], draw="point")
    t = merge([sampled, point]).tree
    # the point draw of 4 repeats a sampled sibling: it is dropped (a no-op under the point-mass rule) and its
    # child 5 joins the first 4
    assert t.tokens.tolist() == [3, 4, 5] and t.parents.tolist() == [-1, -1, 1]
    assert t.kinds == ("iid", "iid", "point") and float(t.q[2].sum()) == 0
    t2 = merge([point, sampled]).tree  # point first: the sampled repeat stays, as a ghost
    assert t2.tokens.tolist() == [4, 3, 4, 5] and t2.parents.tolist() == [-1, -1, -1, 0]
    assert t2.kinds == ("point", "iid", "iid", "point")


def test_merge_of_one_tree_and_of_nothing():
    a = make_tree([1, 2, 3], [-1, 0, 0], q_rows(3), "swor")
    t = merge([a]).tree
    assert torch.equal(t.tokens, a.tokens) and torch.equal(t.parents, a.parents) and torch.equal(t.q, a.q)
    assert t.draw == "swor" and t.kinds is None
    empty = merge([DraftTree.chain([], draw="point")]).tree
    assert len(empty) == 0 and empty.q is None
    greedy_chain = merge([DraftTree.chain([1, 2])]).tree  # no q: deterministic drafts
    assert greedy_chain.draw == "point"


# ---------------------------------------------------------------- prompt lookup


def test_ngram_continuations():
    seq = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    # longest suffix with an earlier occurrence: [1, 2] (n = 3 has none); the most recent occurrence first
    assert ngram_continuations(seq, 3, 3, 1) == [[4, 7, 1]]
    assert ngram_continuations(seq, 3, 2, 3) == [[4, 7], [3, 9]]
    assert ngram_continuations(seq, 3, 2, 5) == [[4, 7], [3, 9]]  # n = 1 finds the same continuations
    assert ngram_continuations([1, 2, 3], 3, 4, 1) == []
    assert ngram_continuations([4], 3, 4, 1) == []
    assert ngram_continuations([7, 7, 7], 3, 4, 2) == [[7], [7, 7]]  # overlapping matches run to the end


def scan(seq: list[int], n_max: int, k: int, branches: int) -> list[tuple[int, list[int]]]:
    """Prompt lookup by brute force, the scan the index replaced: every earlier start of the last n tokens, n = n_max
    down to 1, the most recent first; distinct continuations, at most `branches`."""
    out: list[tuple[int, list[int]]] = []
    for n in range(min(n_max, len(seq) - 1), 0, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            cont = seq[start + n:start + n + k]
            if seq[start:start + n] == seq[-n:] and all(cont != c for _, c in out):
                out.append((n, cont))
                if len(out) >= branches:
                    return out
    return out


def test_the_ngram_index_finds_what_the_scan_finds_as_the_sequence_grows():
    """The drafter's index (NgramIndex) against a brute-force scan, token by token over random sequences of a
    small vocabulary (many repeats), several options; and from scratch where a sequence does not extend the last."""
    rng = random.Random(0)
    for trial in range(40):
        n_max, k, branches = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 4)
        index, seq = NgramIndex(n_max), []
        for _ in range(60):
            seq.append(rng.randrange(3 + trial % 5))
            assert index.matches(seq, k, branches) == scan(seq, n_max, k, branches)
        other = seq[:30] + [9] + seq[31:]  # no longer what was indexed
        assert index.matches(other, k, branches) == scan(other, n_max, k, branches)
        assert index.tokens == other


# ---------------------------------------------------------------- child samplers


def test_swor_draws_follow_key_order_and_skip_zero_mass():
    q = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.3])
    for seed in range(20):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        xs = draw_swor(q, 3, g1)
        u = torch.rand(5, dtype=torch.float64, generator=g2)
        keys = u.log() / q.double()
        assert xs == torch.argsort(keys, descending=True)[:3].tolist()  # descending κ = draw order
        assert len(set(xs)) == 3 and 0 not in xs and 3 not in xs
        assert sorted(draw_swor(q, 10, g1)) == [1, 2, 4]  # capped at |supp q|


def test_swor_first_draw_follows_q_and_second_the_renormalised_rest():
    q = torch.tensor([0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    m = 6000
    pairs = torch.zeros(3, 3)
    for _ in range(m):
        x1, x2 = draw_swor(q, 2, g)
        pairs[x1, x2] += 1
    exp = torch.tensor([[q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for b in range(3)] for a in range(3)]) * m
    keep = exp > 0
    assert chisquare(pairs[keep].numpy(), exp[keep].numpy()).pvalue > 1e-3


def test_iid_draws_and_top_tokens():
    q = torch.tensor([0.0, 1.0, 0.0])
    assert draw_iid(q, 4, torch.Generator().manual_seed(0)) == [1, 1, 1, 1]  # repeats are kept
    logits = torch.tensor([0.5, float("-inf"), 2.0, 1.0])
    assert top_tokens(logits, 2) == [2, 3] and top_tokens(logits, 9) == [2, 3, 0]


# ---------------------------------------------------------------- nested merges keep their sources' draw groups


def _nested_case() -> tuple[DraftTree, DraftTree]:
    """The minimal case: an i.i.d. draw of token 1 and a SWOR sequence (1, 0), both from q = [0.5, 0.3, 0.2]."""
    q = torch.tensor([0.5, 0.3, 0.2])
    iid = DraftTree(torch.tensor([1]), torch.tensor([-1]), q[None], "iid")
    swor = DraftTree(torch.tensor([1, 0]), torch.tensor([-1, -1]), torch.stack([q, q]), "swor")
    return iid, swor


def test_merge_of_a_merged_tree_keeps_its_groups():
    iid, swor = _nested_case()
    inner = merge([iid, swor]).tree
    outer = merge([inner]).tree
    assert inner.groups.tolist() == [0, 1, 1]
    assert outer.groups.tolist() == [0, 1, 1] and outer.kinds == inner.kinds
    assert outer.tokens.tolist() == inner.tokens.tolist()
    nested = merge([merge([inner]).tree, DraftTree(torch.tensor([2]), torch.tensor([-1]), None, "point")]).tree
    g = nested.groups.tolist()
    assert g[0] != g[1] == g[2] != g[3] and g[0] != g[3]  # iid | swor sequence | point: three draw sequences


def test_merge_of_a_merged_tree_verifies_exactly():
    """Exact enumeration: one step verifying merge([merge([iid, swor]), point]) emits tokens with p's law, and
    the old labelling (every child of a merged source in one group) is caught as biased or refused."""
    iid, swor = _nested_case()
    p = torch.tensor([[0.2, 0.0, 0.8]] + [[1 / 3] * 3] * 3)
    with pytest.raises(ValueError, match="mislabelled"):  # what the flattened groups did (the reported bug)
        bad = merge([merge([iid, swor]).tree]).tree
        verify_sampled(DraftTree(bad.tokens, bad.parents, bad.q, bad.draw, bad.kinds, torch.zeros(3, dtype=torch.long)),
                       p, torch.Generator().manual_seed(0))
    for seed in (230, 231):
        a, b, c = (Tables("random", 4, seed=seed + i) for i in range(3))
        sources = [(a.q, (2,), "iid"), (b.q, (2,), "swor"), (c.q, (1,), "point")]
        outcomes = [(math.prod(w for _, w in combo), [tr for tr, _ in combo])
                    for combo in itertools.product(*(list(source_outcomes(*s)) for s in sources))]
        law: dict[tuple[int, ...], float] = defaultdict(float)
        for weight, trees in outcomes:
            nested = merge([merge(trees[:2]).tree, trees[2]]).tree
            for out, prob in real_law(nested, tree_p(a, nested)).items():
                law[out] += weight * prob
        assert l1(as_tensor(law, a, 2), target_law(a, 2)) < EXACT
        flat_law: dict[tuple[int, ...], float] = defaultdict(float)
        try:
            for weight, trees in outcomes:
                nested = merge([merge(trees[:2]).tree, trees[2]]).tree
                # the old labelling: one group per source node, i.e. every child of the merged source in one
                point = nested.kinds is not None and nested.kinds[-1] == "point"
                old = (nested.groups == nested.groups[-1]).long() if point else torch.zeros_like(nested.groups)
                flat = DraftTree(nested.tokens, nested.parents, nested.q, nested.draw, nested.kinds, old)
                for out, prob in real_law(flat, tree_p(a, flat)).items():
                    flat_law[out] += weight * prob
        except ValueError:
            continue  # refused as mislabelled: caught
        assert l1(as_tensor(flat_law, a, 2), target_law(a, 2)) > 1e-3
