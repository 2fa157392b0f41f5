"""`speculor boost-tune` (methods/boost_tune.py) end to end on a tiny random transformers model: the corpus and its
labels, training that learns, boosting that weights the earlier SSMs' misses, determinism with a seed, resuming,
the held-out numbers, and the command on a model folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculor.cli import main
from speculor.methods import boost_data as bd
from speculor.methods import boost_tune as bt
from speculor.runtime.eagle_head import EagleConfig, load_pool

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, HIDDEN = 96, 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def source(model):
    return bd.HFSource(model, tokens_per_batch=512)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(3, 9, (n,), generator=g)]


@pytest.fixture(scope="module")
def data(source):
    """Prepared ids as `prepare` makes them: the target's own greedy answers are the training sequences here."""
    train = bd.answered(prompts(24, 1), source.greedy(prompts(24, 1), 40, [0]))
    return {"train": [(s.ids, s.mask) for s in train], "selfgen": prompts(4, 2), "eos": [0],
            "heldout": {"a": prompts(6, 3), "b": prompts(6, 4)}, "ids": list(range(64))}


def plan(ssms: int = 2, steps: int = 60, seed: int = 0) -> bt.Plan:
    return bt.Plan(EagleConfig(HIDDEN, width=32, ffn=48, blocks=1, vocab=64),
                   bt.TrainConfig(steps=steps, batch=128, lr=3e-3, warmup=5), ssms=ssms, seed=seed)


def test_corpus_positions_and_labels(source, model):
    seqs = [bd.Seq([5, 6, 7, 8, 9, 10, 11, 12], [False, False, True, True, True, True, True, False])]
    c = bd.teacher_force(source, seqs, dtype=torch.float32)
    # a position trains when it predicts a reply token, has a position before it and DEPTHS after it
    assert c.positions.tolist() == [2, 3]
    ids = torch.arange(VOCAB)
    p = bt.Labels(c, source.out_rows(ids)).p(torch.arange(8))
    full = model(torch.tensor([seqs[0].ids])).logits[0].softmax(-1)
    assert torch.allclose(p, full, atol=1e-5)  # p over every id is the target's own law
    assert torch.equal(c.g, full.argmax(-1))


def test_training_learns_and_boosting_weights_the_misses(source, data, tmp_path):
    manifest = bt.run(source, data, plan(ssms=1, steps=0), tmp_path / "untrained", selfgen_tokens=20,
                      answer_tokens=20, dtype=torch.float32, own=False)
    before = manifest["heldout"]["a"]["ssm1"]["accepted_length"][-1]
    manifest = bt.run(source, data, plan(ssms=3, steps=150), tmp_path / "pool", selfgen_tokens=20,
                      answer_tokens=20, dtype=torch.float32)
    runs = manifest["ssm_runs"]
    assert manifest["heldout"]["a"]["ssm1"]["accepted_length"][-1] > before + 0.1
    missed = [r["train_positions_missed_by_all"] for r in runs]
    assert missed == sorted(missed, reverse=True) and missed[-1] < missed[0]
    assert runs[1]["weighted_positions_missed_before"] == missed[0]
    pool = manifest["heldout"]["a"]["pool"]["acceptance"][0]
    assert pool >= max(manifest["heldout"]["a"][f"ssm{k}"]["acceptance"][0] for k in (1, 2, 3))
    heads, saved = load_pool(tmp_path / "pool")
    assert len(heads) == 3 and saved["data"]["selfgen_answers"] == 4 and 0 in heads[0].ids.tolist()


def test_a_seed_fixes_the_heads_and_a_run_resumes(source, data, tmp_path):
    a = bt.run(source, data, plan(ssms=2), tmp_path / "a", selfgen_tokens=8, answer_tokens=12, dtype=torch.float32)
    b = bt.run(source, data, plan(ssms=1), tmp_path / "b", selfgen_tokens=8, answer_tokens=12, dtype=torch.float32)
    b = bt.run(source, data, plan(ssms=2), tmp_path / "b", selfgen_tokens=8, answer_tokens=12, dtype=torch.float32)
    assert a["heldout"] == b["heldout"] and len(b["ssm_runs"]) == 2
    (ha, _), (hb, _) = load_pool(tmp_path / "a"), load_pool(tmp_path / "b")
    for x, y in zip(ha, hb, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x.state_dict().values(), y.state_dict().values(), strict=True))


def test_own_vocab_keeps_the_end_tokens(source, data):
    c = bd.teacher_force(source, [bd.Seq(i, m) for i, m in data["train"]], dtype=torch.float32)
    ids = bd.own_vocab(c, 8, [0, 3])
    assert len(ids) == 8 and {0, 3} <= set(ids.tolist())
    top = torch.bincount(c.g[c.positions], minlength=VOCAB).argmax().item()
    assert top in ids.tolist()


def test_the_command_on_a_model_folder(model, data, tmp_path, capsys):
    from support.server import tiny_tokenizer

    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    torch.save(data, tmp_path / "prepared.pt")
    code = main(["boost-tune", "--feature-source", "transformers", "--target", str(tmp_path / "tiny"), "--prepared",
                 str(tmp_path / "prepared.pt"), "--ssms", "2", "--steps", "20", "--batch", "64", "--width", "16",
                 "--ffn", "16", "--blocks", "1", "--answer-tokens", "12", "--selfgen-tokens", "8",
                 "--out", str(tmp_path / "pool")])
    assert code == 0
    manifest = json.loads((tmp_path / "pool" / "manifest.json").read_text())
    assert manifest["ssms"] == 2 and manifest["config"]["vocab"] == 64 and "--prepared" in manifest["command"]
    assert "saved the pool of 2 heads" in capsys.readouterr().out
