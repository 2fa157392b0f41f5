"""The per-request KV cache (`runtime.cache.KVCache`) and the model apart from the request (`runtime.model.Model`):
writes by position, compaction that moves only the accepted rows, growth, and requests that share one model
without sharing state (tiny random Qwen2, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from support.tiny import VOCAB, reference_logits, tiny_model

from speculor import SamplingConfig, engine
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.engine.loop import one_step
from speculor.runtime import cache as cache_module
from speculor.runtime.backend import forward1
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(tiny_model(0))


def test_keep_moves_only_the_accepted_rows(model):
    cache = model.new_cache()
    prefix = [5, 9, 11, 2, 40]
    forward1(model, cache, prefix)
    cache.keep(list(range(len(prefix))))
    layer = cache.layers[0]
    buf, before = layer.k_buf.data_ptr(), layer.k_buf.clone()
    # a tree under the last committed token: 0 -> 1 -> 3, 0 -> 2; 4 under the root
    forward1(model, cache, [7, 8, 9, 10, 12], torch.tensor([-1, 0, 0, 1, -1]))
    pending = layer.k_buf[..., 5:10, :].clone()
    cache.keep([0, 1, 3])
    assert cache.length == 8 and len(cache.pending) == 0 and cache.get_seq_length() == 8
    assert layer.k_buf.data_ptr() == buf  # no new buffer: the prefix was not copied
    assert torch.equal(layer.k_buf[..., :5, :], before[..., :5, :])  # committed entries untouched
    assert torch.equal(layer.k_buf[..., 5:8, :], pending[..., [0, 1, 3], :])  # accepted rows moved in order
    # the next forward sees exactly prefix + the accepted path
    logits = forward1(model, cache, [3]).logits
    assert (logits[0] - reference_logits(model.model, prefix + [7, 8, 10, 3])).abs().max() < 1e-4


def test_trim_and_growth_keep_the_cache_right(model, monkeypatch):
    monkeypatch.setattr(cache_module, "CAPACITY", 4)  # force several doublings
    cache = model.new_cache()
    seq = [(7 * i + 3) % VOCAB for i in range(37)]
    for i in range(0, len(seq), 5):  # blocks of 5: the buffers start at 5 slots and double three times
        forward1(model, cache, seq[i:i + 5])
        cache.keep(list(range(len(seq[i:i + 5]))))
    assert cache.length == len(seq) and cache.layers[0].k_buf.shape[-2] == 40  # 5 (the first block), 10, 20, 40
    assert (forward1(model, cache, [1]).logits[0] - reference_logits(model.model, seq + [1])).abs().max() < 1e-4
    cache.trim(10)
    assert cache.length == 10 and cache.get_seq_length() == 10 and len(cache.pending) == 0
    assert (forward1(model, cache, [1]).logits[0] - reference_logits(model.model, seq[:10] + [1])).abs().max() < 1e-4


def test_requests_share_the_model_not_their_state(model):
    """Two requests decoded step by step in turn on one target and one draft model emit exactly what each emits
    alone: the models hold no request state (greedy, a chain and a tree drafter)."""
    draft = Model(tiny_model(1, layers=1))
    cfg = SamplingConfig(max_new_tokens=12)
    prompts = [[3, 14, 15, 9, 2, 6], [27, 18, 28]]
    makers = [lambda: ChainDrafter(draft, 3), lambda: TreeDrafter(draft, [-1, -1, 0, 1, 2], "swor")]
    alone = [[t.id for t in engine.stream(model, make(), p, cfg)] for make, p in zip(makers, prompts, strict=True)]
    reqs = [engine.start(model, make(), p, cfg) for make, p in zip(makers, prompts, strict=True)]
    out: list[list[int]] = [[], []]
    while any(len(o) < cfg.max_new_tokens for o in out):
        for i, req in enumerate(reqs):
            if len(out[i]) >= cfg.max_new_tokens:
                continue
            verdict, tree, _ = one_step(model, req)
            for tok in [int(tree.tokens[j]) for j in verdict.path] + [verdict.token]:
                req.seq.append(tok)
                out[i].append(tok)
    assert [o[:cfg.max_new_tokens] for o in out] == alone
    assert alone[0] != alone[1]


def test_sampled_requests_depend_on_their_own_seed_only(model):
    """At temperature > 0 a request's output is decided by its seed: interleaving it with another request
    (another seed, another temperature) does not change it."""
    draft = Model(tiny_model(1, layers=1))
    a = SamplingConfig(temperature=0.9, seed=11, max_new_tokens=10)
    b = SamplingConfig(temperature=1.3, top_p=0.9, seed=12, max_new_tokens=10)
    prompt = [4, 8, 15, 16, 23, 42]
    alone = [t.id for t in engine.stream(model, ChainDrafter(draft, 2), prompt, a)]
    ra = engine.start(model, ChainDrafter(draft, 2), prompt, a)
    rb = engine.start(model, TreeDrafter(draft, [-1, -1, 0], "iid"), prompt, b)
    got: list[int] = []
    while len(got) < a.max_new_tokens:
        for req in (rb, ra):
            verdict, tree, _ = one_step(model, req)
            toks = [int(tree.tokens[j]) for j in verdict.path] + [verdict.token]
            req.seq.extend(toks)
            if req is ra:
                got.extend(toks)
    assert got[:a.max_new_tokens] == alone
