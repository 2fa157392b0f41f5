"""The lean draft forward (runtime/lean.py) on tiny random Qwen2/Llama models (no download): its logits and hidden
states equal the stock `Model.forward`'s for prompts, tree blocks, appended depths, after keep/trim, with last=True,
through int8 kernels and a restricted head; it never calls transformers' forward; drafters with a lean draft give
the target's plain greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny import VOCAB, WORDS, perturbed, tiny_model, word_tokenizer

from speculor import Model, SamplingConfig, SpeculorError, engine, load_pair
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.runtime.backend import Block, forward1
from speculor.runtime.draft_vocab import restrict_head
from speculor.runtime.kernels import Int8Linear, PackedLinear, pack_linears
from speculor.runtime.lean import LeanDecoder, Part, fuse_projections, joint, supports

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


def int8(model, kind=Int8Linear):
    out = copy.deepcopy(model)
    pack_linears(out, kind)
    return out


def joined(model, kind=None):
    out = copy.deepcopy(model)
    assert fuse_projections(out, kind) == 2 * out.config.num_hidden_layers  # q/k/v and gate/up of every layer
    return out


def restricted(model):
    out = copy.deepcopy(model)
    restrict_head(out, torch.arange(0, VOCAB, 2))
    return out


MODELS = {"qwen2": lambda: tiny_model(0), "llama": lambda: tiny_model(1, family="llama"),
          "mha": lambda: tiny_model(2, kv_heads=4),
          "int8": lambda: int8(tiny_model(3)), "restricted": lambda: restricted(tiny_model(4)),
          "onednn": lambda: int8(tiny_model(8), PackedLinear),
          "joined": lambda: joined(tiny_model(13)), "int8-joined": lambda: int8(joined(tiny_model(14))),
          "int8-joined-at-once": lambda: int8(joined(tiny_model(16), Int8Linear)),
          "llama-joined": lambda: int8(joined(tiny_model(15, family="llama")))}


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to fp32 summation order; -inf (a restricted head's ids outside the subset) at the same places."""
    assert a.shape == b.shape
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert (a[torch.isfinite(a)] - b[torch.isfinite(b)]).abs().max() < TOL


# each step: (method, tokens, parents or None, keyword arguments) or ("keep", rows) / ("trim", n)
SCRIPT = [
    ("forward", list(range(3, 40)), None, {}),  # a prompt (a chain)
    ("keep", list(range(37))),
    ("forward", [5, 6, 7, 8, 9], [-1, 0, 0, 1, 1], {}),  # a tree block
    ("forward", [10, 11, 12], [3, 4, 2], {"append": True}),  # one more depth, appended
    ("forward", [13], [5], {"append": True, "hidden": True}),
    ("keep", [0, 1, 4, 7]),  # an accepted path: rows moved, the rest dropped
    ("forward", [14, 15, 16, 17], [-1, -1, 1, 1], {}),  # a forest
    ("forward", [18], None, {"append": True}),  # continues the last pending row
    ("keep", [0, 2]),
    ("trim", 40),  # roll back two committed entries
    ("forward", [19, 20, 21], None, {"last": True}),
    ("forward", [22, 23], None, {"last": True, "hidden": True}),
    ("keep", [0, 1]),
    ("forward", [24], None, {}),  # one row that sees every entry: no mask
    ("forward", [25], None, {"hidden": True}),
]


@pytest.mark.parametrize("name", list(MODELS))
def test_lean_forward_equals_the_stock_forward(name):
    module = MODELS[name]()
    stock, lean = Model(module), Model(module, lean=True)
    assert (lean.lean.qkv[0] is not None) == (lean.lean.gate_up[0] is not None) == ("joined" in name)
    caches = stock.new_cache(), lean.new_cache()
    for step in SCRIPT:
        if step[0] in ("keep", "trim"):
            for cache in caches:
                getattr(cache, step[0])(step[1])
            continue
        _, tokens, parents, kw = step
        parents = None if parents is None else torch.tensor(parents, dtype=torch.long)
        ra, rb = (forward1(m, c, tokens, parents, **kw) for m, c in zip((stock, lean), caches, strict=True))
        a, b = ra.logits, rb.logits
        if kw.get("hidden"):
            assert rb.hidden.shape == (len(tokens), 32)
            same(ra.hidden, rb.hidden)
        else:
            assert ra.hidden is None and rb.hidden is None
        assert b.shape == (1 if kw.get("last") else len(tokens), VOCAB)
        same(a, b)
        assert torch.equal(caches[0].pending, caches[1].pending)
    for x, y in zip(caches[0].layers, caches[1].layers, strict=True):  # the same keys and values were written
        assert x.n == y.n
        same(x.keys, y.keys)
        same(x.values, y.values)


def test_lean_forward_skips_transformers_forward():
    module = tiny_model(5)
    lean = Model(module, lean=True)
    calls = []
    module.forward = lambda *a, **k: calls.append(1)
    logits = forward1(lean, lean.new_cache(), [1, 2, 3]).logits
    assert calls == [] and logits.shape == (3, VOCAB) and torch.isfinite(logits).all()


def test_blocks_of_a_lean_model_give_each_block_its_logits():
    module = tiny_model(6)
    stock, lean = Model(module), Model(module, lean=True)
    prompts, blocks = [[3, 1, 4, 1, 5], [9, 2]], [([6, 7, 8], [-1, 0, 0]), ([2], [-1])]
    out = {}
    for m in (stock, lean):
        caches = []
        for p in prompts:
            caches.append(m.new_cache())
            forward1(m, caches[-1], p)
            caches[-1].keep(list(range(len(p))))
        out[m] = m.forward([Block(c, t, torch.tensor(par)) for c, (t, par) in zip(caches, blocks, strict=True)])
    for a, b in zip(out[stock], out[lean], strict=True):
        same(a.logits, b.logits)


def test_unsupported_models_are_refused():
    module = tiny_model(7)
    module.config.layer_types = ["sliding_attention"] * 2
    assert not supports(module)
    with pytest.raises(SpeculorError, match="lean forward"):
        Model(module, lean=True)
    with pytest.raises(SpeculorError):
        LeanDecoder(torch.nn.Linear(2, 2))


def plain(target: Model, prompt: list[int], n: int) -> list[int]:
    return [t.id for t in engine.stream(target, None, prompt, SamplingConfig(max_new_tokens=n))]


@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_a_lean_draft_gives_the_plain_greedy_tokens(drafter):
    target = Model(tiny_model(10))
    near = perturbed(target.model, 0.05, seed=0)
    draft = Model(int8(joined(near) if drafter == "tree" else near), lean=True)
    stats = engine.Stats()
    for prompt in ([1, 2, 3, 4, 5], [42], [7, 7, 7, 7, 9, 11]):
        d = ChainDrafter(draft, 3) if drafter == "chain" else TreeDrafter(draft, [-1, -1, 0, 0, 1, 2, 2, 4])
        spec = [t.id for t in engine.stream(target, d, prompt, SamplingConfig(max_new_tokens=24), stats=stats)]
        assert spec == plain(target, prompt, 24), f"prompt {prompt}"
    assert len({s.accepted for s in stats.steps}) >= 2  # partial acceptance: the draft cache was compacted


@pytest.mark.parametrize("kind", [None, Int8Linear, PackedLinear])
def test_joined_projections_keep_the_models_outputs_and_one_weight_copy(kind):
    """fuse_projections then pack_linears: transformers' own forward gives the same logits through the Parts, each
    joined matrix is packed once (3 + 2 linears a layer become 2), an int8 row keeps its scale."""
    apart, one, at_once = tiny_model(9), joined(tiny_model(9)), joined(tiny_model(9), kind)
    if kind is not None:
        assert pack_linears(apart, kind) == 2 * 7 + 1 and pack_linears(one, kind) == 2 * 4 + 1
        assert pack_linears(at_once, kind) == 2 * 2 + 1  # o, down and the head: the joined ones were packed already
        same(one(torch.tensor([[2, 7]])).logits, at_once(torch.tensor([[2, 7]])).logits)
    attn, mlp = one.model.layers[1].self_attn, one.model.layers[1].mlp
    assert isinstance(attn.k_proj, Part) and attn.q_proj.whole is attn.k_proj.whole is attn.v_proj.whole
    assert type(attn.q_proj.whole) is (kind or torch.nn.Linear) and mlp.up_proj.whole.out_features == 2 * 64
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        same(apart(ids).logits, one(ids).logits)


def test_joint_takes_only_parts_of_one_linear_in_order():
    whole = torch.nn.Linear(4, 6)
    a, b, c = Part(whole, 0, 2), Part(whole, 2, 4), Part(whole, 4, 6)
    assert joint([a, b, c]) is whole
    assert joint([b, a, c]) is None and joint([a, b]) is None  # out of order; not the whole
    assert joint([a, b, Part(torch.nn.Linear(4, 6), 4, 6)]) is None  # another linear's part
    assert joint([torch.nn.Linear(4, 2), b, c]) is None


def test_load_pair_runs_only_the_draft_lean(tmp_path):
    """Lean is the default for an int8 draft, never for the target, off with lean_draft=False or eager kernels."""
    for name, seed in (("target", 11), ("draft", 12)):
        tiny_model(seed).save_pretrained(tmp_path / name)
        word_tokenizer(WORDS[:VOCAB]).save_pretrained(tmp_path / name)
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), backend="torch")  # default: a lean int8 draft
    assert pair.target.lean is None and isinstance(pair.draft.lean, LeanDecoder)
    assert pair.draft.lean.qkv[0] is not None  # its projections joined
    assert load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), lean_draft=False, backend="torch"
                     ).draft.lean is None
    assert load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), packed=False, draft_int8=False,
                     backend="torch").draft.lean is None  # eager kernels: the models' own forward
    prompt = [4, 5, 6, 7]
    spec = [t.id for t in engine.stream(pair.target, ChainDrafter(pair.draft, 2), prompt,
                                        SamplingConfig(max_new_tokens=10))]
    assert spec == plain(pair.target, prompt, 10)
