"""SpecDec++ (docs §7) without downloads: the head, its file, the labels and loss, the stopping rule with its
one-token lag, the drafter on toy and tiny Qwen2 pairs (output identical to plain decoding whatever the head; exact
law by chi-square), thresholds, training on synthetic features, and the transformers peers' settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support.stats import goodness_of_fit
from support.tiny import WORDS, near_pair, reference_greedy, tiny_model
from support.toy import PROMPT, N, V, exact_law, plain_greedy, random_toy
from support.toy import perturbed as toy_perturbed

from speculor import Model, Pair, SamplingConfig, Speculor, SpeculorError, engine
from speculor.bench.peers import ASSISTANT_SETTINGS, generation_settings, hf_generate
from speculor.drafters import specdecpp
from speculor.drafters.registry import make_strategy
from speculor.drafters.specdecpp import (
    AcceptanceHead,
    HeadConfig,
    SpecDecPPDrafter,
    StopRule,
    draft_length,
    load_head,
    save_head,
)
from speculor.methods import specdecpp_data, specdecpp_train
from speculor.methods.specdecpp_data import DataConfig, Features, mix, soft_labels
from speculor.methods.specdecpp_train import TrainConfig, weighted_bce
from speculor.runtime.backend import forward1

pytestmark = pytest.mark.usefixtures("one_thread")


def random_head(hidden: int, seed: int = 0, layers: int = 3, scale: float = 1.0) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(HeadConfig(hidden, layers))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(scale)
    return head.eval()


# ---------------------------------------------------------------- the head and its file


def test_head_shapes_and_separate_blocks():
    head = random_head(16)
    assert head(torch.randn(5, 16)).shape == (5, 2)
    assert head(torch.randn(2, 3, 16)).shape == (2, 3, 2)
    p = head.accept_prob(torch.randn(7, 16))
    assert p.shape == (7,) and bool(((p > 0) & (p < 1)).all())
    assert len(head.blocks) == 3 and len({id(b.weight) for b in head.blocks}) == 3  # not one shared block
    assert not torch.equal(head.blocks[0].weight, head.blocks[1].weight)
    assert sum(p.numel() for p in head.parameters()) == 3 * (16 * 16 + 16) + 16 * 2 + 2
    with torch.no_grad():
        head.mu.normal_()
        head.sigma.uniform_(0.5, 2.0)
    x = torch.randn(4, 16)  # standardise, x <- x + SiLU(Wx + b) three times, then the linear output
    h = (x - head.mu) / head.sigma
    for b in head.blocks:
        h = h + torch.nn.functional.silu(h @ b.weight.T + b.bias)
    assert torch.allclose(head(x), h @ head.out.weight.T + head.out.bias, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(hidden_size=0), dict(hidden_size=8, layers=-1), dict(hidden_size=2.5)])
def test_head_config_is_validated(bad):
    with pytest.raises(SpeculorError):
        HeadConfig(**bad)


def test_save_load_round_trip(tmp_path: Path):
    head = random_head(24, seed=3)
    with torch.no_grad():
        head.mu.normal_()
        head.sigma.uniform_(0.5, 2.0)
    path = tmp_path / "h.safetensors"
    save_head(head, path, {"draft": {"name": "x", "sha256": "abc"}, "training": {"temperature": 1.0}})
    loaded, record = load_head(path)
    assert record["hidden_size"] == 24 and record["layers"] == 3 and record["draft"]["name"] == "x"
    assert record["training"]["temperature"] == 1.0
    assert path.stat().st_size < 24 * 24 * 3 * 2 + 4096  # fp16 weights
    x = torch.randn(9, 24)
    with torch.no_grad():
        rounded = AcceptanceHead(HeadConfig(24, 3))
        keep = ("mu", "sigma")  # saved in fp32
        rounded.load_state_dict({k: v if k in keep else v.half().float() for k, v in head.state_dict().items()})
        assert torch.equal(loaded.mu, rounded.mu) and torch.equal(loaded.sigma, rounded.sigma)
        assert torch.allclose(loaded(x), rounded(x), atol=1e-6)
        assert torch.allclose(loaded(x), head(x), atol=1e-2)


def test_load_head_errors(tmp_path: Path):
    with pytest.raises(SpeculorError, match="train-head"):
        load_head(tmp_path / "missing.safetensors")
    path = tmp_path / "h.safetensors"
    save_head(random_head(8), path, {})
    record = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps(record | {"hidden_size": 9}))
    with pytest.raises(SpeculorError):
        load_head(path)


# ---------------------------------------------------------------- labels, mixing and the loss


def test_soft_labels_are_min_one_p_over_q():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.25, 0.6, 0.15], [0.2, 0.4, 0.4]])
    y = torch.tensor([1, 2])
    got = soft_labels(p.log() + 3.0, q.log() - 1.0, y)  # logits up to a constant: log-softmax removes it
    assert torch.allclose(got, torch.tensor([0.3 / 0.6, 1.0]), atol=1e-6)
    assert torch.allclose(soft_labels(q.log(), q.log(), y), torch.ones(2))


def test_mix_takes_true_tokens_with_probability_r():
    x, y = torch.zeros(20000, dtype=torch.long), torch.ones(20000, dtype=torch.long)
    z, from_y = mix(x, y, 0.15, torch.Generator().manual_seed(0))
    assert torch.equal(z, from_y.long())
    assert abs(float((~from_y).float().mean()) - 0.15) < 0.01
    z0, m0 = mix(x[:10], y[:10], 0.0, None)
    assert bool(m0.all()) and torch.equal(z0, y[:10])


def test_weighted_bce_matches_a_hand_computation():
    # P̂_acc = 0.75, 0.5, 0.2 (logits [0, log 3], [0, 0], [log 4, 0]); y = 1, 0, 0.5; w = 6
    logits = torch.tensor([[0.0, math.log(3)], [0.0, 0.0], [math.log(4), 0.0]])
    y = torch.tensor([1.0, 0.0, 0.5])
    num = (1 * -math.log(0.75)) + (6 * 1 * -math.log(0.5)) + (6 * 0.5 * -math.log(0.8) + 0.5 * -math.log(0.2))
    den = 1 + 6 + (3 + 0.5)
    assert abs(float(weighted_bce(logits, y, 6.0)) - num / den) < 1e-6
    # w = 1 with hard labels is the plain mean cross-entropy
    hard = torch.tensor([1.0, 0.0, 1.0])
    ce = torch.nn.functional.cross_entropy(logits, hard.long())
    assert abs(float(weighted_bce(logits, hard, 1.0)) - float(ce)) < 1e-6


def test_weighted_optimum_and_its_inverse():
    """The w-weighted loss is minimised at P̂ = y / (y + w (1 - y)); deweight inverts that map."""
    y = torch.tensor([0.3])
    best = y / (y + 6 * (1 - y))
    grid = torch.linspace(0.01, 0.99, 99)
    losses = [float(weighted_bce(torch.tensor([[0.0, math.log(g / (1 - g))]]), y, 6.0)) for g in grid]
    assert abs(float(grid[int(torch.tensor(losses).argmin())]) - float(best)) < 0.011
    assert torch.allclose(specdecpp_train.deweight(best, 6.0), y, atol=1e-6)


# ---------------------------------------------------------------- the stopping rule


def test_stop_rule_with_the_one_token_lag():
    rule = StopRule(0.5, 2, 20)
    # P̂ for Y_3 is 0.1: known only after Y_4 was drafted, so the chain has 4 tokens, not 3
    assert draft_length([1.0, 1.0, 0.1] + [1.0] * 20, rule) == 4
    assert draft_length([0.9, 0.9, 0.9] + [0.1] * 20, rule) == 5  # cum 0.9^3 = 0.729 after Y_4, 0.07 after Y_5
    assert draft_length([0.6, 0.6, 0.6, 0.6], StopRule(0.3, 2, 20)) == 2  # 1 - 0.6 > 0.3 at j = 2
    assert draft_length([0.8] * 30, StopRule(0.5, 2, 20)) == 5  # cum at j = 4 is 0.8^3 = 0.51, at j = 5 0.8^4 = 0.41
    assert draft_length([1.0] * 30, rule) == 20  # K_max
    assert draft_length([0.0] * 30, rule) == 2  # K_min, although Y_1 looks hopeless
    assert draft_length([0.0] * 30, StopRule(0.5, 1, 20)) == 2  # j = 1 never stops on P̂ (Y_0 counts as 1)
    assert draft_length([0.0] * 30, StopRule(0.5, 3, 3)) == 3
    assert draft_length([0.95] * 30, StopRule(0.0, 2, 20)) == 2  # h = 0: stop as soon as a P̂ < 1 is known
    assert draft_length([1.0, 0.95] + [1.0] * 30, StopRule(0.0, 2, 20)) == 3
    assert draft_length([0.01] * 30, StopRule(1.0, 2, 7)) == 7  # h = 1: never stops before K_max


@pytest.mark.parametrize("bad", [dict(threshold=-0.1), dict(threshold=1.5), dict(k_min=0), dict(k_min=5, k_max=4),
                                 dict(k_max=65), dict(threshold="0.3")])
def test_stop_rule_is_validated(bad):
    with pytest.raises(SpeculorError):
        StopRule(**bad)


class ScriptedHead:
    """P̂ of a toy draft position = table[its input token] (the toy's hidden state is the one-hot input token)."""

    def __init__(self, table: list[float]) -> None:
        self.table, self.seen = table, []

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        token = int(hidden.argmax())
        self.seen.append(token)
        return torch.tensor(self.table[token])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_follows_the_rule_on_scripted_head_outputs(temperature):
    target = random_toy(V, seed=0)
    table = [0.9, 0.6, 0.97, 0.8, 0.99, 0.7]
    head = ScriptedHead(table)
    rule = StopRule(0.4, 2, 9)
    drafter = SpecDecPPDrafter(Model(toy_perturbed(target, seed=1, noise=0.8)), head, 0.4, 2, 9)
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=2)
    lengths, calls = [], []
    orig = drafter.propose

    def propose(seq, c, g):
        head.seen.clear()
        tree = yield from orig(seq, c, g)  # a proposal: the engine answers its forward requests
        toks = tree.tokens.tolist()
        lengths.append((len(toks), draft_length([table[t] for t in toks], rule)))
        calls.append((list(head.seen), toks[:-1], drafter.forwards, len(toks)))
        return tree

    drafter.propose = propose
    out = [t.id for t in engine.stream(Model(target), drafter, PROMPT, cfg)]
    assert len(out) == 40 and len(lengths) >= 5
    assert all(k == want for k, want in lengths)
    assert len({k for k, _ in lengths}) > 1  # the length does vary
    for seen, fed, forwards, k in calls:
        assert seen == fed  # P̂_j comes from the position whose input is Y_j, for j < K (the lag)
        assert forwards == k


def test_greedy_toy_output_is_plain_greedy_for_any_threshold():
    target = random_toy(V, seed=0)
    draft = toy_perturbed(target, seed=1, noise=0.8)
    for h in (0.0, 0.3, 0.9, 1.0):
        for prompt in ([0], [1, 2], [5, 4, 3, 2]):
            drafter = SpecDecPPDrafter(Model(draft), random_head(V, seed=5, scale=3.0), h, 1, 6)
            out = [t.id for t in engine.stream(Model(target), drafter, prompt, SamplingConfig(max_new_tokens=17))]
            assert out == plain_greedy(target, prompt, 17)


def test_first_tokens_follow_the_exact_law():
    """Chi-square on the toy: sampling with a random head's adaptive chains keeps the target's law (T = 1)."""
    target = random_toy(V, seed=0)
    draft = toy_perturbed(target, seed=1, noise=0.8)
    drafter = SpecDecPPDrafter(Model(draft), random_head(V, seed=7, scale=3.0), 0.5, 1, 4)
    t_model, m = Model(target), 3000
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        cfg = SamplingConfig(temperature=1.0, max_new_tokens=N, seed=1000 + i)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, PROMPT, cfg))] += 1
    pvalue, tv, floor = goodness_of_fit(counts, exact_law(target, PROMPT, SamplingConfig(temperature=1.0), N))
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f}, noise floor {floor:.4f})"
    assert tv < 2 * floor


# ---------------------------------------------------------------- tiny Qwen2 pair


@pytest.fixture(scope="module")
def tiny_pair() -> Pair:
    return near_pair()


@pytest.mark.parametrize("threshold", [0.05, 0.5, 0.95])
def test_tiny_qwen2_greedy_identical_with_a_random_head(tiny_pair, threshold):
    head = random_head(32, seed=11, scale=2.0)
    for prompt in ([1, 2, 3, 4, 5], [42], [99, 0, 13, 56, 21, 8, 3, 71, 30]):
        drafter = SpecDecPPDrafter(tiny_pair.draft, head, threshold, 2, 20)
        stats = engine.Stats()
        out = [t.id for t in engine.stream(tiny_pair.target, drafter, prompt, SamplingConfig(max_new_tokens=24),
                                           stats=stats)]
        assert out == reference_greedy(tiny_pair.target.model, prompt, 24)
        assert all(2 <= s.drafted <= 20 for s in stats.steps)


def test_strategy_registry_with_a_head_file(tiny_pair, tmp_path: Path):
    path = tmp_path / "head.safetensors"
    save_head(random_head(32, seed=4), path, {"draft": {"name": "tiny", "sha256": "0" * 64}})
    sp = Speculor(tiny_pair, strategy="plain")
    cfg = SamplingConfig(max_new_tokens=20)
    plain = sp.generate([5, 6, 7], cfg).token_ids
    with pytest.warns(UserWarning, match="trained for the draft"):
        out = sp.generate([5, 6, 7], cfg, strategy="specdecpp", head=str(path), threshold=0.4, k_max=8)
    assert out.token_ids == plain and out.tau >= 1
    with pytest.raises(SpeculorError, match="threshold"):
        make_strategy("specdecpp", tiny_pair, head=str(path), threshold=2.0)
    with pytest.raises(SpeculorError, match="no SpecDec"):
        make_strategy("specdecpp", tiny_pair, head=str(tmp_path / "nope.safetensors"))
    save_head(random_head(16), tmp_path / "small.safetensors", {})
    with pytest.raises(SpeculorError, match="hidden size"):
        make_strategy("specdecpp", tiny_pair, head=str(tmp_path / "small.safetensors"))


def test_sequence_features_use_the_mixed_sequence(tiny_pair):
    """Labels are 1 for a draft identical to the target; hidden rows are those of prompt + Z where Z = Y."""
    same = Pair(tiny_pair.target, tiny_pair.target, tiny_pair.tokenizer)  # one Model in both roles
    cfg = DataConfig(mixing_ratio=0.3)
    prompt, x = [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14]
    hidden, labels = specdecpp_data.sequence_features(same, prompt, x, cfg, torch.Generator().manual_seed(0))
    assert torch.allclose(labels, torch.ones_like(labels), atol=1e-5)
    # replay the generator: Y, then the mix
    g = torch.Generator().manual_seed(0)
    q_logits = specdecpp_data.teacher_logits(same.draft, same.draft.new_cache(), prompt, x)
    y = torch.multinomial(torch.softmax(q_logits, -1), 1, generator=g)[:, 0]
    z, from_y = mix(torch.tensor(x), y, 0.3, g)
    with torch.no_grad():
        ref = same.target.model(input_ids=torch.tensor([prompt + z.tolist()]), output_hidden_states=True)
    want = ref.hidden_states[-1][0, len(prompt):][from_y]
    assert hidden.shape == want.shape and torch.allclose(hidden, want, atol=1e-4)


@pytest.mark.parametrize("committed", [0, 4])
def test_model_forward_last_gives_the_last_logits_only(tiny_pair, committed):
    model = tiny_pair.draft
    cache, ref = model.new_cache(), model.new_cache()
    prefix, block = [9, 8, 7, 6], [5, 17, 33, 2, 61]
    for c in (cache, ref):
        if committed:
            forward1(model, c, prefix[:committed])
            c.keep(list(range(committed)))
    got, want = forward1(model, cache, block, hidden=True, last=True), forward1(model, ref, block, hidden=True)
    logits, hidden, want_logits, want_hidden = got.logits, got.hidden, want.logits, want.hidden
    assert logits.shape == (1, want_logits.shape[-1])
    assert torch.equal(hidden, want_hidden) and torch.allclose(logits, want_logits[-1:], atol=1e-5)
    cache.keep(list(range(len(block))))
    assert cache.length == committed + len(block) and cache.get_seq_length() == cache.length


def test_data_config_split_and_validation():
    cfg = DataConfig(heldout=0.1)
    held = [i for i in range(100) if cfg.is_heldout(i)]
    assert len(held) == 10 and held == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]
    for bad in (dict(sequences=0), dict(mixing_ratio=1.0), dict(heldout=0.0), dict(max_prompt=250, min_reply=16)):
        with pytest.raises(SpeculorError):
            DataConfig(**bad)


# ---------------------------------------------------------------- training, calibration, thresholds


def synthetic_features(n: int, hidden: int, seed: int) -> Features:
    """Labels that depend on the hidden state: y = sigmoid(3 x_0) (soft), so a head can learn them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    return Features(x, torch.sigmoid(3 * x[:, 0]), torch.arange(n))


def test_training_lowers_the_held_out_loss():
    train, held = synthetic_features(2048, 8, 0), synthetic_features(512, 8, 1)
    cfg = TrainConfig(epochs=8, batch_size=128, lr=1e-2)
    before = specdecpp_train.evaluate(AcceptanceHead(HeadConfig(8, 3)), held, 6.0)
    result = specdecpp_train.train_head(train, held, cfg, progress=False)
    after = specdecpp_train.evaluate(result.head, held, 6.0)
    assert after < 0.8 * before and len(result.history) == 9 and result.best_epoch > 0
    assert result.history[result.best_epoch]["heldout_loss"] == pytest.approx(after, rel=1e-5)
    # epoch 0 is the best constant predictor: P̂ = sum y / (sum y + w sum (1 - y)) everywhere
    p0 = specdecpp_train.constant_accept(train.labels, 6.0)
    const = torch.tensor([[math.log(1 - p0), math.log(p0)]]).expand(len(held), 2)
    assert result.history[0]["heldout_loss"] == pytest.approx(float(weighted_bce(const, held.labels, 6.0)), rel=1e-4)
    rows = specdecpp_train.calibration(result.head, held, bins=10)
    assert sum(r["count"] for r in rows) == 512
    assert specdecpp_train.calibration_error(rows, 6.0) < 0.05  # calibrated against the weighted optimum


def test_lr_schedule():
    f = [specdecpp_train.lr_factor(s, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[-1] < 0.01 and all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


def test_thresholds_resolution(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    head = tmp_path / "h.safetensors"
    specdecpp.save_threshold(specdecpp.beside_head(head), "sha", 0.0, {"threshold": 0.7})
    specdecpp.save_threshold(specdecpp.beside_head(head), "sha", 0.7, {"threshold": 0.2})
    assert specdecpp.resolve_thresholds(head, "sha") == {0.0: 0.7, 0.7: 0.2}
    specdecpp.save_threshold(specdecpp.threshold_path("sha"), "sha", 0.7, {"threshold": 0.5})  # this machine's
    assert specdecpp.resolve_thresholds(head, "sha") == {0.0: 0.7, 0.7: 0.5}
    assert specdecpp.resolve_thresholds(head, "other") == {}  # tuned for another head: ignored
    assert specdecpp.nearest_temperature([0.0, 0.7], 0.0) == 0.0
    assert specdecpp.nearest_temperature([0.0, 0.7], 1.2) == 0.7
    assert specdecpp.nearest_temperature([0.0, 0.7], 0.1) == 0.7  # sampling prefers a sampling entry
    assert specdecpp.nearest_temperature([0.7], 0.0) == 0.7
    drafter = SpecDecPPDrafter(Model(random_toy(V)), None, {0.0: 0.7, 0.7: 0.2})  # the rule needs no head
    assert drafter.rule(SamplingConfig()).threshold == 0.7
    assert drafter.rule(SamplingConfig(temperature=1.0)).threshold == 0.2


# ---------------------------------------------------------------- transformers peers


@pytest.mark.parametrize("name", ["hf-assisted-heuristic", "hf-assisted-confidence"])
def test_adaptive_peers_are_greedy_identical_and_restore_the_draft_config(tiny_pair, name):
    gc = tiny_pair.draft.model.generation_config
    before = {k: getattr(gc, k) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                          "assistant_confidence_threshold")}
    prompt = [1, 2, 3, 4, 5]
    tokens, _ = hf_generate(tiny_pair, name, prompt, SamplingConfig(max_new_tokens=12, stop_on_eos=False),
                            frozenset())
    assert tokens == reference_greedy(tiny_pair.target.model, prompt, 12)
    assert {k: getattr(gc, k) for k in before} == before


def test_generation_settings_restore_on_error():
    model = tiny_model(0, hidden=16, layers=1, vocab=len(WORDS), context=64)
    gc = model.generation_config
    old = gc.num_assistant_tokens
    with pytest.raises(RuntimeError), generation_settings(model, ASSISTANT_SETTINGS["hf-assisted-heuristic"]):
        assert gc.num_assistant_tokens_schedule == "heuristic"
        gc.num_assistant_tokens = 11  # what transformers writes back after a heuristic run
        raise RuntimeError
    assert gc.num_assistant_tokens == old and gc.num_assistant_tokens_schedule != "heuristic"
