"""Decoding under a grammar (llguidance) with toy LMs: the masked target's law, exact, through the real verifier and
the engine; T = 0 identical to plain constrained decoding, alone and batched; the tree walk with rollback; forced
runs computed by fills; negative controls that drop the mask at tree nodes."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from support.exact import EXACT, Tables, iid_draws, l1, real_law
from support.stats import goodness_of_fit
from support.toy import ToyLM, random_toy

import speculor.engine.steps as steps
from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.tree import DraftTree
from speculor.drafters.chain import ChainDrafter
from speculor.engine.batch import Active, step
from speculor.errors import SpeculorError
from speculor.grammar.compile import Constraint, Grammars
from speculor.grammar.state import GrammarState, masked
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = [b"a", b"b", b"ab", b"{", b"}", b""]  # the toy vocabulary's bytes; 5 is the end token
EOS = 5
V = len(TOKENS)
PROMPT = [1, 2]


class ByteTokenizer:
    """The toy vocabulary as llguidance's TokenizerWrapper reads it: bytes per token, an end token, and a tokenizer
    (longest match first)."""

    tokens = TOKENS
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, s: bytes | str) -> list[int]:
        s = s.encode() if isinstance(s, str) else s
        out, i = [], 0
        while i < len(s):
            best = max((j for j, t in enumerate(TOKENS) if t and s.startswith(t, i)), key=lambda j: len(TOKENS[j]))
            out.append(best)
            i += len(TOKENS[best])
        return out


ONE = Constraint("lark", 'start: "{" /[ab]{2,8}/ "}"')  # "{" forced first; "}" once two letters are in; then EOS
TWO = Constraint("lark", 'start: "{" /[ab]{1,3}/ "}" "{" /[ab]{1,3}/ "}"')  # a forced "{" in the middle


@pytest.fixture(scope="module")
def grammars():
    return Grammars(ByteTokenizer(), V)


def state(grammars, constraint=ONE) -> GrammarState:
    return GrammarState(grammars.matcher(constraint), V, frozenset({EOS}))


def toy_target(seed: int = 0) -> ToyLM:
    return random_toy(V, seed=seed)


def run(target, draft, cfg, grammars, constraint=ONE, k=2, root=False, prompt=PROMPT) -> list[int]:
    model = Model(target)
    model.traits = replace(model.traits, root_in_prompt=root)
    drafter = ChainDrafter(Model(draft), k) if draft is not None else None
    return [t.id for t in engine.stream(model, drafter, prompt, cfg, frozenset({EOS}),
                                        grammar=state(grammars, constraint))]


def allowed_after(grammars, constraint, tokens) -> torch.Tensor:
    g = state(grammars, constraint)
    for t in tokens:
        g.advance(t)
    return g.allowed()


def reference_greedy(target: ToyLM, grammars, constraint, prompt, n) -> list[int]:
    """Constrained greedy decoding straight from the toy's tables: the argmax over the allowed tokens."""
    out: list[int] = []
    while len(out) < n:
        z = target.next_logits(prompt + out).detach()
        t = int(torch.argmax(z.masked_fill(~allowed_after(grammars, constraint, out), float("-inf"))))
        out.append(t)
        if t == EOS:
            break
    return out


# ---------------------------------------------------------------- T = 0


@pytest.mark.parametrize("constraint", [ONE, TWO], ids=["one", "two"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("root", [False, True])
def test_greedy_under_a_grammar_equals_plain_constrained(grammars, constraint, k, root):
    for seed in range(4):
        target = toy_target(seed)
        cfg = SamplingConfig(max_new_tokens=12)
        plain = run(target, None, cfg, grammars, constraint, root=root)
        assert plain == reference_greedy(target, grammars, constraint, PROMPT, 12)
        assert run(target, target, cfg, grammars, constraint, k=k, root=root) == plain  # every draft accepted
        assert run(target, toy_target(seed + 10), cfg, grammars, constraint, k=k, root=root) == plain
        assert plain[0] == 3 and plain[-1] == EOS  # the forced "{" and the forced end


def test_forced_tokens_are_filled_not_decided(grammars):
    """A forced run's rows are computed by a fill (one block of several rows), not decided step by step: plain
    constrained decoding makes fewer steps than it emits tokens, and the forced tokens come without a draft flag."""
    target = toy_target(1)
    stats = engine.Stats()
    model = Model(target)
    toks = list(engine.stream(model, None, PROMPT, SamplingConfig(max_new_tokens=12), frozenset({EOS}), stats,
                              grammar=state(grammars, TWO)))
    ids = [t.id for t in toks]
    forced = sum(1 for i in range(len(ids)) if int(allowed_after(grammars, TWO, ids[:i]).sum()) == 1)
    assert forced >= 3  # "{" first, "{" in the middle, the end token
    assert len(stats.steps) == len(ids) - forced and stats.forced == forced


def test_a_batch_gives_each_request_its_answer_alone(grammars):
    target, draft = toy_target(2), toy_target(7)
    cfgs = [SamplingConfig(max_new_tokens=n) for n in (12, 5, 9)]
    alone = [run(target, draft, c, grammars, TWO, k=2, root=True, prompt=[i, 1]) for i, c in enumerate(cfgs)]
    model = Model(target)
    model.traits = replace(model.traits, root_in_prompt=True)
    batch = [Active(engine.start(model, ChainDrafter(Model(draft), 2), [i, 1], c, prefill=False,
                                 grammar=state(grammars, TWO)), frozenset({EOS})) for i, c in enumerate(cfgs)]
    got: list[list[int]] = [[] for _ in batch]
    live = list(range(len(batch)))
    while live:
        for i, toks in zip(live, step(model, [batch[i] for i in live]), strict=True):
            got[i] += [t.id for t in toks]
        live = [i for i in live if not batch[i].done]
    assert got == alone


# ---------------------------------------------------------------- the tree walk


def test_walk_masks_every_path_and_rolls_back(grammars):
    g = state(grammars)
    g.advance(3)  # "{"
    before = g.allowed()
    #   root -> a(0) -> b(1) -> }(2) ; a(0) -> }(3) forbidden after one letter ; root -> ab(4) -> }(5) ; root -> {(6)
    tree = DraftTree(torch.tensor([0, 1, 4, 4, 2, 4, 3]), torch.tensor([-1, 0, 1, 0, -1, 4, -1]), draw="point")
    walk = g.walk(tree, greedy=False)
    assert torch.equal(g.allowed(), before)  # rolled back
    assert walk.origin == list(range(7))
    for i in range(7):
        path = [3] + [int(tree.tokens[j]) for j in _path(tree, i)]
        if all(bool(allowed_after(grammars, ONE, path[:d])[path[d]]) for d in range(1, len(path))):
            assert torch.equal(walk.masks[i + 1], allowed_after(grammars, ONE, path))
    cut = g.walk(tree, greedy=True)  # forbidden: } after "a", { ; forcing: } (the end token follows)
    assert cut.origin == [0, 1, 4] and cut.tree.tokens.tolist() == [0, 1, 2]
    assert cut.tree.parents.tolist() == [-1, 0, -1]


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]


# ---------------------------------------------------------------- exact law: enumeration through the real verifier


def masked_p(t: Tables, grammars, ctx: tuple[int, ...]) -> torch.Tensor:
    p = t.p[ctx] * allowed_after(grammars, ONE, (3,) + ctx).double()
    return p / p.sum()


@pytest.mark.parametrize("case", ["random", "q_zeros", "q_eq_p"])
@pytest.mark.parametrize("drop_mask", [False, True])
def test_verifying_chains_under_a_grammar_gives_the_masked_law(grammars, case, drop_mask):
    """Every chain of 2 i.i.d. draws from the (unmasked) draft q, weighted by its probability, verified by
    verify_sampled against the masked p of each row: the emitted tokens follow the masked target exactly. Negative
    control: masking the root row alone (tree rows unmasked) is caught."""
    t = Tables(case, V, seed=5)
    g = state(grammars)
    g.advance(3)
    law: dict[tuple[int, ...], float] = {}
    for xs, w in iid_draws(t.q[()], 1):
        for ys, w2 in iid_draws(t.q[(xs[0],)], 1):
            tree = DraftTree(torch.tensor(xs + ys), torch.tensor([-1, 0]),
                             torch.stack([t.q[()], t.q[(xs[0],)]]), "iid")
            walk = g.walk(tree, greedy=False)
            ctx = [()] + [tuple(int(walk.tree.tokens[j]) for j in _path(walk.tree, i)) for i in range(len(walk.tree))]
            rows = torch.stack([t.p[c] for c in ctx])  # a forbidden node's children are never reached: cut
            masks = walk.masks if not drop_mask else torch.cat([walk.masks[:1], torch.ones_like(walk.masks[1:])])
            p = masked(rows.log(), masks).softmax(-1)
            for seq, pr in real_law(walk.tree, p).items():
                law[seq] = law.get(seq, 0.0) + w * w2 * pr
    n = 3
    got, want = torch.zeros([V] * n, dtype=torch.float64), torch.zeros([V] * n, dtype=torch.float64)
    for cell in itertools.product(range(V), repeat=n):
        pw = 1.0
        for i, x in enumerate(cell):
            pw *= float(masked_p(t, grammars, cell[:i])[x])
            if pw == 0:
                break
        want[cell] = pw
    for seq, pr in law.items():
        if pr == 0 or not all(bool(allowed_after(grammars, ONE, (3,) + seq[:i])[seq[i]]) for i in range(len(seq))):
            got[seq + (0,) * (n - len(seq))] += pr  # mass on a forbidden sequence: counted where none is expected
            continue
        for rest in itertools.product(range(V), repeat=n - len(seq)):
            full = seq + rest
            w = pr
            for i in range(len(seq), n):
                w *= float(masked_p(t, grammars, full[:i])[full[i]])
                if w == 0:
                    break
            got[full] += w
    if drop_mask:
        assert l1(got, want) > 1e-3
    else:
        assert l1(got, want) < EXACT * 100


# ---------------------------------------------------------------- exact law: chi-square through the engine

N = 4


def engine_counts(target, draft, m: int, root: bool) -> torch.Tensor:
    model, drafter = Model(target), ChainDrafter(Model(draft), 2)
    model.traits = replace(model.traits, root_in_prompt=root)
    g = Grammars(ByteTokenizer(), V)
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        cfg = SamplingConfig(temperature=1.0, max_new_tokens=N, seed=4000 + i)
        toks = [t.id for t in engine.stream(model, drafter, PROMPT, cfg, frozenset({EOS}), grammar=state(g))]
        counts[tuple(toks)] += 1
    return counts


def masked_law(target: ToyLM, grammars) -> torch.Tensor:
    law = torch.zeros([V] * N, dtype=torch.float64)
    for cell in itertools.product(range(V), repeat=N):
        pw = 1.0
        for i, x in enumerate(cell):
            z = target.next_logits(PROMPT + list(cell[:i])).detach().double()
            p = z.masked_fill(~allowed_after(grammars, ONE, cell[:i]), float("-inf")).softmax(-1)
            pw *= float(p[x])
            if pw == 0:
                break
        law[cell] = pw
    return law


@pytest.mark.parametrize("root", [False, True])
def test_sampling_under_a_grammar_follows_the_masked_law(grammars, root):
    target, draft = toy_target(3), toy_target(4)
    law = masked_law(target, grammars)
    assert abs(float(law.sum()) - 1) < 1e-9
    pvalue, tv, floor = goodness_of_fit(engine_counts(target, draft, 3000, root), law)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f}, floor {floor:.4f})"


def test_chi_square_catches_tree_rows_left_unmasked(grammars, monkeypatch):
    """Negative control: the mask applied to the root row alone. Accepted draft tokens then follow the unmasked p
    (or break the grammar): the harness must see it."""
    monkeypatch.setattr(steps, "masked", lambda z, m: masked(z, torch.cat([m[:1], torch.ones_like(m[1:])])))
    target, draft = toy_target(3), toy_target(4)
    try:
        counts = engine_counts(target, draft, 3000, False)
    except SpeculorError:
        return  # a forbidden draft token accepted: caught
    pvalue, _, _ = goodness_of_fit(counts, masked_law(target, grammars))
    assert pvalue < 1e-6


# ---------------------------------------------------------------- bad constraints


@pytest.mark.parametrize("constraint", [Constraint("lark", "start: nope"), Constraint("json_schema", '{"type": 3}'),
                                        Constraint("gbnf", "root ::= ("), Constraint("regex", "(")])
def test_a_constraint_that_does_not_compile_is_a_clear_error(grammars, constraint):
    with pytest.raises(SpeculorError, match="does not compile|invalid"):
        grammars.matcher(constraint)


def test_compiled_once_and_never_shared(grammars):
    a, b = state(grammars), state(grammars)
    a.advance(3)
    assert not torch.equal(a.allowed(), b.allowed())  # b is still at the start
    assert ONE in grammars._templates
