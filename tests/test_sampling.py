"""SamplingConfig validation and the pure sampling functions (warp, check_finite, residual, greedy, sample)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from speculor import SamplingConfig, SpeculorError
from speculor.core.sampling import check_finite, draw_iid, greedy, residual, sample, warp

# ---------------------------------------------------------------- SamplingConfig


def test_defaults_are_greedy_and_valid():
    cfg = SamplingConfig()
    assert cfg.greedy and cfg.temperature == 0 and cfg.top_k == 0 and cfg.top_p == 1
    assert cfg.max_new_tokens > 0 and cfg.stop == () and cfg.stop_on_eos
    assert not SamplingConfig(temperature=0.7).greedy


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1.0"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 4.0}, "max_new_tokens"),
    ({"seed": "7"}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"stop": ("ok", "")}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": (3,)}, "stop"),
])
def test_bad_values_raise_a_clear_error(kwargs, field):
    with pytest.raises(SpeculorError, match=field):
        SamplingConfig(**kwargs)


def test_speculor_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0)


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"top_p": 1e-6},
                                    {"top_k": 0}, {"top_k": 50}, {"max_new_tokens": 1}, {"seed": 0}])
def test_edge_values_are_accepted(kwargs):
    SamplingConfig(**kwargs)


def test_stop_string_becomes_a_tuple_and_config_is_frozen():
    cfg = SamplingConfig(stop="\n\n")
    assert cfg.stop == ("\n\n",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------- warp


LOGITS = torch.tensor([1.0, 3.0, -0.5, 2.0, 0.0])


@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_warp_temperature(t):
    probs = warp(LOGITS, SamplingConfig(temperature=t))
    assert torch.allclose(probs, torch.softmax(LOGITS / t, -1), atol=1e-7)
    assert probs.dtype == torch.float32


def test_warp_computes_in_fp32():
    probs = warp(LOGITS.to(torch.bfloat16), SamplingConfig(temperature=1.0))
    assert probs.dtype == torch.float32 and abs(float(probs.sum()) - 1) < 1e-6


def test_lower_temperature_is_sharper():
    cold, hot = (warp(LOGITS, SamplingConfig(temperature=t)) for t in (0.5, 2.0))
    assert cold.max() > hot.max() and cold.argmax() == hot.argmax() == 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_warp_top_k_keeps_the_k_largest(k):
    probs = warp(LOGITS, SamplingConfig(temperature=1.0, top_k=k))
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == set(torch.topk(LOGITS, k).indices.tolist())
    expect = torch.softmax(LOGITS, -1) * (probs > 0)
    assert torch.allclose(probs, expect / expect.sum(), atol=1e-7)


@pytest.mark.parametrize("k", [0, 5, 9])
def test_warp_top_k_off_or_larger_than_vocab(k):
    assert torch.allclose(warp(LOGITS, SamplingConfig(temperature=1.0, top_k=k)), torch.softmax(LOGITS, -1))


def test_warp_top_k_keeps_ties():
    probs = warp(torch.tensor([2.0, 1.0, 2.0, 0.0]), SamplingConfig(temperature=1.0, top_k=1))
    assert probs.tolist() == [0.5, 0.0, 0.5, 0.0]


# probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order
P4 = torch.tensor([0.15, 0.5, 0.05, 0.3])


@pytest.mark.parametrize(("top_p", "kept"), [
    (0.3, {1}),  # 0.5 >= 0.3 already
    (0.49, {1}),
    (0.6, {1, 3}),  # 0.5 < 0.6 <= 0.8
    (0.79, {1, 3}),
    (0.81, {1, 3, 0}),  # 0.8 < 0.81 <= 0.95
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_warp_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, kept):
    probs = warp(P4.log(), SamplingConfig(temperature=1.0, top_p=top_p))
    assert set(torch.nonzero(probs).flatten().tolist()) == kept
    idx = sorted(kept)
    assert torch.allclose(probs[idx], P4[idx] / P4[idx].sum(), atol=1e-6)
    assert abs(float(probs.sum()) - 1) < 1e-6


@pytest.mark.parametrize("first", [1, 8, 64, 10**9])
def test_top_p_among_the_largest_first_equals_the_full_sort(first, monkeypatch):
    """top-p looks among the TOP_P_FIRST largest first, the whole row when they do not reach p: the same tokens
    kept either way, on peaked and flat rows."""
    import speculor.core.sampling as sampling

    z = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * torch.tensor([[4.0], [1.0], [0.1]])
    probs = torch.softmax(z, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) >= 0.9)
    want = probs.masked_fill(drop, 0.0)
    monkeypatch.setattr(sampling, "TOP_P_FIRST", first)
    got = sampling.top_p(probs, 0.9)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want / want.sum(-1, keepdim=True))


def test_warp_top_p_tiny_keeps_the_argmax():
    assert warp(P4.log(), SamplingConfig(temperature=1.0, top_p=1e-6)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_warp_rows_independently_and_sum_to_one():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(7, 11, generator=g)
    cfg = SamplingConfig(temperature=0.8, top_k=6, top_p=0.7)
    probs = warp(logits, cfg)
    assert probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(7), atol=1e-6)
    assert (probs >= 0).all()
    for i in range(7):
        assert torch.equal(probs[i], warp(logits[i], cfg))
        assert 1 <= int((probs[i] > 0).sum()) <= 6


def test_warp_top_k_before_top_p():
    """top-k cuts the logits first; top-p then works on the renormalised top-k distribution."""
    probs = warp(P4.log(), SamplingConfig(temperature=1.0, top_k=2, top_p=0.7))
    # top-2 = {1: 0.5/0.8, 3: 0.3/0.8} = {0.625, 0.375}; 0.625 < 0.7 so both stay
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6)


def test_warp_padded_vocab_entries_get_zero():
    probs = warp(torch.tensor([0.0, 1.0, -math.inf]), SamplingConfig(temperature=1.0, top_p=0.99))
    assert probs[2] == 0 and abs(float(probs.sum()) - 1) < 1e-6


# ---------------------------------------------------------------- check_finite, greedy, sample, residual


def test_check_finite_raises_on_nan():
    check_finite(torch.tensor([0.0, -math.inf, 2.0]), "target")  # -inf is a legal logit (a padded entry)
    with pytest.raises(SpeculorError, match="draft model produced NaN"):
        check_finite(torch.tensor([[0.0, math.nan]]), "draft")


def test_greedy_lowest_id_on_ties():
    assert greedy(torch.tensor([0.0, 2.0, 1.0, 2.0])) == 1
    assert greedy(torch.zeros(5)) == 0


def test_sample_point_mass_and_seeded():
    assert sample(torch.tensor([0.0, 0.0, 1.0]), None) == 2
    probs = torch.tensor([0.2, 0.3, 0.5])
    draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert draws == [sample(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert set(draws) <= {0, 1, 2}


@pytest.mark.parametrize("unnormalised", [1.0, 3.7])
def test_draws_follow_the_probabilities_and_never_a_zero_mass_token(unnormalised):
    """The inverse-CDF draws (chi-square against probs), and a negative control: the same counts against the
    probabilities with two entries swapped are rejected."""
    from scipy.stats import chisquare

    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.05, 0.4, 0.0], dtype=torch.float64) * unnormalised
    got = torch.bincount(torch.tensor(draw_iid(probs, 40000, torch.Generator().manual_seed(1))), minlength=7)
    assert int(got[probs == 0].sum()) == 0
    keep = probs > 0
    law = probs[keep] / probs[keep].sum()
    assert chisquare(got[keep].double(), law * got.sum()).pvalue > 1e-3
    swapped = law[[0, 2, 1, 3]]
    assert chisquare(got[keep].double(), swapped * got.sum()).pvalue < 1e-3


def test_a_draw_rounded_past_the_last_cumulative_mass_takes_the_last_token_with_mass(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(a[0], dtype=torch.float64))
    assert draw_iid(torch.tensor([0.3, 0.7, 0.0, 0.0]), 2, None) == [1, 1]


def test_residual_is_the_normalised_positive_part():
    r = torch.tensor([0.5, 0.3, 0.2, 0.0])
    d = torch.tensor([0.2, 0.5, 0.1, 0.2])
    res = residual(r, d)
    assert torch.allclose(res, torch.tensor([0.75, 0.0, 0.25, 0.0]))
    assert abs(float(res.sum()) - 1) < 1e-7 and (res >= 0).all()


def test_residual_zero_where_d_covers_r():
    """After a rejection of x (r(x) < d(x)) the residual has no mass on x."""
    r = torch.tensor([0.1, 0.6, 0.3])
    d = torch.tensor([0.7, 0.2, 0.1])
    res = residual(r, d)
    assert res[0] == 0 and torch.isfinite(res).all() and abs(float(res.sum()) - 1) < 1e-6


def test_residual_without_mass_is_none():
    p = torch.tensor([0.25, 0.25, 0.5])
    assert residual(p, p) is None
    assert residual(p, p.clone() + 1e-14) is None
    assert residual(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) is None
