"""tree.py: depths, ancestors, the 4-D tree attention mask, depth-based positions, paths, block indices, DraftTree."""

from __future__ import annotations

import pytest
import torch

from speculor.core.tree import DraftTree, ancestors, attention_mask, block_parents, depths, path_to, position_ids

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
