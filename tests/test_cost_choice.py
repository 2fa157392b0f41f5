"""Decisions made from a cost curve: `--backend auto`'s prediction (runtime/choice.py), DySpec's alone check (can a
chain pay at all?) and the n-gram cut (drafters/lookup.py), on a flat curve (fp32 torch-like: rows nearly free)
and a steep one (llama.cpp-like: t(2) = 1.6 t(1), a draft forward half a target step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.costs import GENTLE, timed

from speculor.config import SamplingConfig
from speculor.core.goodput import BatchLedger
from speculor.core.verify import Verdict
from speculor.drafters import lookup
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.ngram import NgramDrafter
from speculor.engine.drafting import drive
from speculor.runtime import cost as cost_module
from speculor.runtime import profiling
from speculor.runtime.call_times import CallTimes
from speculor.runtime.choice import acceptance, predicted
from speculor.runtime.cost import CostModel, Measured, steady

N = tuple(range(1, 17))
FLAT = CostModel(N, tuple(0.5 + 0.01 * n for n in N), N, tuple(0.05 + 0.003 * n for n in N))
STEEP = CostModel(N, tuple(0.05 * (1 + 0.6 * (n - 1)) for n in N), N, tuple(0.025 * (1 + 0.6 * (n - 1)) for n in N))


def test_prediction_follows_the_curve():
    rate, k = predicted(FLAT, 0.84)
    assert k >= 4 and rate > 2 / FLAT.t_target(1)  # nearly free rows: a long chain, until the draft's cost tells
    rate, k = predicted(STEEP, 0.84)
    assert k == 0 and rate == pytest.approx(1 / STEEP.t_target(1))  # the draft costs more than it brings
    assert predicted(CostModel(N, STEEP.target_s, N, tuple(0.0 for _ in N)), 0.99)[1] > 0  # a free, good drafter


def test_the_embedded_pairs_acceptance():
    assert 0.5 < acceptance("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct") < 1


def test_dyspec_alone_drafts_only_where_a_chain_could_pay():
    from support.toy import random_toy

    from speculor.runtime.model import Model

    draft = Model(random_toy(6, seed=0))
    assert DySpecDrafter(draft, DySpecOptions(budget="auto"), FLAT).can_pay
    assert not DySpecDrafter(draft, DySpecOptions(budget="auto"), STEEP).can_pay


def step(drafter, seq, accepted):
    tree = drive(drafter.propose(seq, SamplingConfig(), None))
    drafter.observe(len(seq), Verdict(list(range(min(accepted, len(tree.tokens)))), 0))
    return len(tree.tokens)


def test_ngram_cuts_to_what_the_curve_pays_and_learns():
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6, 7]  # the 3-gram 5 6 7 recurs: 8 9 10 ... follows
    assert step(NgramDrafter(k=8, cost=FLAT), seq, 8) == 8  # flat: the whole continuation
    assert step(NgramDrafter(k=8), seq, 8) == 8  # no curve: always k
    steep = NgramDrafter(k=8, cost=STEEP)
    first = step(steep, seq, 8)
    assert 1 <= first < 8  # the 3-gram's prior (0.8) pays a short try only
    sizes = [step(steep, seq, 8) for _ in range(6)]
    assert sizes[-1] > first  # every token accepted: longer cuts
    failing = NgramDrafter(k=8, cost=STEEP)
    tried = [step(failing, seq, 0) for _ in range(30)]
    assert tried[1] == 0  # rejected: it stops drafting at this match length
    assert sum(t > 0 for t in tried) >= 2  # ... and tries again once its counts have faded


def test_ngram_starts_from_its_match_length_s_prior(monkeypatch):
    """Before anything is verified a copy after a 1-token match is believed at 0.3, under the 0.6 t(1) a row costs on
    the steep curve (not tried), one after a 3-token match at 0.8 (tried); one prior of 0.7 for every length tries
    both (the control)."""
    one = [5, 8, 9, 10, 11, 3, 5]  # only the 1-gram 5 recurs
    three = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6, 7]
    assert step(NgramDrafter(k=8, cost=STEEP), one, 8) == 0 and step(NgramDrafter(k=8, cost=STEEP), three, 8) > 0
    monkeypatch.setattr(lookup, "PRIOR", ((1.4, 0.6),))
    assert step(NgramDrafter(k=8, cost=STEEP), one, 8) > 0


def test_ngram_in_a_batch_prices_the_batch_s_step():
    """Beside 15 requests decoding plainly a copy that pays alone does not (what was learned is not faded by that),
    nothing is copied beside a prompt chunk, and an empty ledger is the single-request rule."""
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6, 7]
    d = NgramDrafter(k=8, cost=STEEP)
    assert d.batch_aware and not NgramDrafter(k=8).batch_aware
    alone = step(d, seq, 8)
    learned = (d.reached[3], d.accepted[3])
    d.ledger = BatchLedger(rows=15, tokens=15.0)
    assert 1 <= alone and step(d, seq, 0) == 0 and (d.reached[3], d.accepted[3]) == learned
    d.ledger = BatchLedger(filling=True)
    assert step(d, seq, 0) == 0
    d.ledger = BatchLedger()
    assert step(d, seq, 8) > 0 and d.expected_tokens > 1


def test_timed_calls_reprice_the_curve():
    """t(n) = t_profile(n) (q ρ_3 + ρ_r) / (q π_3 + π_r): t(1) stays the profile's, sizes timed fewer than SEEN times
    keep the profile's ratio, calls of more rows than the limit are not counted."""
    pi = [GENTLE.t_target(k) / GENTLE.t_target(1) for k in (1, 2, 3)]
    cost = Measured(GENTLE, timed({1: 1.0, 3: 2.4}))
    assert cost.t_target(1) == pytest.approx(GENTLE.t_target(1))
    assert cost.t_target(3) == pytest.approx(GENTLE.t_target(3) * 2.4 / pi[2])
    assert cost.t_target(2) == pytest.approx(GENTLE.t_target(2))  # never timed: the profile's
    assert cost.t_target(7) == pytest.approx(GENTLE.t_target(7) * (2 * 2.4 + 1) / (2 * pi[2] + 1))
    assert cost.t_draft(4) == GENTLE.t_draft(4)
    few = Measured(GENTLE, timed({1: 1.0, 3: 2.4}, times=CallTimes.SEEN - 1))
    assert few.t_target(3) == pytest.approx(GENTLE.t_target(3))
    calls = timed({1: 1.0, 3: 2.4})
    calls.add(8, 9.0)
    assert calls.n[1:] == [CallTimes.SEEN, 0, CallTimes.SEEN]
    calls.add(3, 0.05 * 3.4)  # a call moves its size's average by ALPHA
    assert calls.ratio(3) == pytest.approx(2.4 + CallTimes.ALPHA * 1.0)


def test_timed_ratios_compare_calls_at_the_same_context():
    """Every call's time grows with its context, the 2-row ones always 1.7 one-row calls of the moment: a request on
    a long context (t(1) 60 ms) with a few 2-row calls, then one on a short context (40 ms) that makes none. The ratio
    stays 1.7; the ratio of the two moving averages (the control) would read 60 · 1.7 / 40 = 2.55."""
    calls = CallTimes(3)
    for _ in range(30):
        calls.add(1, 0.060)
        calls.add(2, 0.060 * 1.7)
    for _ in range(60):
        calls.add(1, 0.040)
    assert calls.ratio(2) == pytest.approx(1.7) and calls.ratio(1) == 1.0
    assert calls.s[2] / calls.s[1] == pytest.approx(2.55, rel=0.01)  # c(2) / c(1): what ratio() no longer reads


def test_a_profile_the_machine_moved_off_is_measured_again(tmp_path, monkeypatch):
    """`drifted`: t(k)/t(1) timed now off the profile's by more than STALE; `cached_cost` then measures and saves
    anew, once a process (a seeded sampled request's tree follows from the curve it reads); a profile within STALE,
    or a target that does not time its calls (torch), is read as saved."""
    pi = {k: GENTLE.t_target(k) / GENTLE.t_target(1) for k in (2, 3)}
    now = {}
    monkeypatch.setattr(profiling, "time_forwards", lambda model, sizes, **kw: [now[n] for n in sizes])
    now.update({1: 1.0, 2: pi[2] * 1.1, 3: pi[3] * 0.9})
    assert not profiling.drifted(None, GENTLE)
    now[3] = pi[3] * 1.2  # t(3)/t(1) 20% dearer than profiled
    assert profiling.drifted(None, GENTLE)
    fresh = CostModel((1, 2), (1.0, 2.0), (1, 2), (0.0, 0.0))
    path = tmp_path / "cost.json"
    GENTLE.save(path)
    for stale, want in ((lambda c: False, GENTLE.target_s), (lambda c: True, fresh.target_s)):
        monkeypatch.setattr(cost_module, "_COSTS", {})
        got = cost_module.cached_cost(path, lambda: fresh, stale)
        assert got.target_s == want and CostModel.load(path).target_s == want
        assert cost_module.cached_cost(path, lambda: GENTLE, lambda c: True) is got  # once a process
    monkeypatch.setattr(cost_module, "_COSTS", {})
    torch_like = SimpleNamespace(target=SimpleNamespace(call_times=None), draft=None)
    monkeypatch.setattr(profiling, "cost_path", lambda pair: path)
    monkeypatch.setattr(profiling, "drifted", lambda *a: pytest.fail("a torch target's profile is not re-timed"))
    assert profiling.machine_cost(torch_like).target_s == fresh.target_s


def test_ngram_prices_its_cut_by_the_timed_calls_unless_seeded():
    """On a gentle profile a copy pays; where the calls are timed steep it does not (the same drafter, the same
    acceptance); a seeded sampled request prices by the profile alone (its tree must follow from its seed)."""
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6, 7]
    steep = Measured(GENTLE, timed({1: 1.0, 2: 3.0, 3: 4.5}))  # a row costs more than a call
    assert step(NgramDrafter(k=8, cost=GENTLE), seq, 8) > 0
    assert step(NgramDrafter(k=8, cost=Measured(GENTLE, timed({1: 1.0, 2: 1.15, 3: 1.3}))), seq, 8) > 0
    assert step(NgramDrafter(k=8, cost=steep), seq, 8) == 0
    seeded = SamplingConfig(temperature=0.7, seed=3)
    d = NgramDrafter(k=8, cost=steep)
    assert len(drive(d.propose(seq, seeded, None)).tokens) == step(NgramDrafter(k=8, cost=GENTLE), seq, 8)
    assert steady(steep, True) is GENTLE and steady(steep, False) is steep and steady(GENTLE, True) is GENTLE


def test_auto_says_what_it_chose_and_measures_nothing_where_only_torch_runs(monkeypatch, capsys):
    """A GPU, a pair that is not GGUF or a torch-only option: torch at once, one stderr line saying why."""
    from speculor.runtime import choice

    def measured(*a, **k):
        raise AssertionError("nothing is loaded or measured")

    monkeypatch.setattr(choice, "measure", measured)
    cases = [(("default", "default", "cuda"), {}, "--device cuda"),
             (("/models/target", "/models/draft", "cpu"), {}, "runs GGUF files"),
             (("default", "default", "cpu"), {"only_torch": "--draft-vocab restricts a torch draft's head"},
              "--draft-vocab")]
    for (target, draft, device), kw, why in cases:
        assert choice.choose(target, draft, device=device, threads=2, **kw) == "torch"
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("speculor: --backend auto chose torch: ") and why in line, line
    assert choice.candidates("/models/target.gguf", None, "cuda:0") == ["torch"]


def test_auto_refuses_a_device_before_measuring(monkeypatch):
    import speculor
    from speculor.errors import SpeculorError
    from speculor.runtime import choice

    monkeypatch.setattr(choice, "choose", lambda *a, **k: pytest.fail("measured before the device check"))
    with pytest.raises(SpeculorError, match="--offload streams"):
        speculor.load_pair(offload=True)  # the default backend, auto, on the CPU


def test_auto_is_chosen_before_loading(monkeypatch, tmp_path):
    """`speculor.load_pair` resolves "auto" first (runtime/resolve.py, with runtime/choice.py's choice) and hands the
    plan, its backend concrete, to prepare and then to load, once each; no plan is made for "auto"."""
    import speculor
    from speculor.errors import SpeculorError
    from speculor.runtime import choice, loading
    from speculor.runtime.plan import make_plan
    from speculor.runtime.spec import PairSpec

    gguf, folder = tmp_path / "t.gguf", tmp_path / "t"
    gguf.write_bytes(b"GGUF")
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    stages = []
    monkeypatch.setattr(choice, "choose", lambda target, draft, **kw: "llama.cpp")
    monkeypatch.setattr(loading, "prepare", lambda plan: stages.append(("prepare", plan)) or "files")
    monkeypatch.setattr(loading, "load", lambda prepared: stages.append(("load", prepared)) or "pair")
    assert speculor.load_pair(str(gguf), None, threads=2) == "pair"
    assert stages == [("prepare", make_plan(PairSpec(str(gguf), None, backend="llama.cpp", threads=2))),
                      ("load", "files")]
    speculor.load_pair(PairSpec(str(folder), backend="torch"))  # a concrete backend: nothing chosen
    assert stages[-2] == ("prepare", make_plan(PairSpec(str(folder), backend="torch")))
    assert stages[-2][1].backend == "torch"
    monkeypatch.undo()
    with pytest.raises(SpeculorError, match="chosen before loading"):
        make_plan(PairSpec())
    with pytest.raises(SpeculorError, match="a PairSpec or the fields of one"):
        speculor.load_pair(PairSpec(), backend="torch")
    with pytest.raises(SpeculorError, match="unknown backend"):
        speculor.load_pair(backend="gpu")


def test_auto_with_a_llama_cpp_call_class_takes_llama_cpp_unmeasured(monkeypatch, capsys, tmp_path):
    """--calls vector (or batched) is a llama.cpp setting: auto takes llama.cpp without measuring torch (which would
    refuse the setting after its profile), says why, and refuses a pair llama.cpp cannot run."""
    import speculor
    from speculor.errors import SpeculorError
    from speculor.runtime import choice
    from speculor.runtime.plan import make_plan
    from speculor.runtime.resolve import resolve
    from speculor.runtime.spec import PairSpec

    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(choice, "choose", lambda *a, **k: pytest.fail("measured for a llama.cpp setting"))
    monkeypatch.setattr(choice, "torch_only", lambda target, draft, device: "")
    plan = resolve(PairSpec(str(gguf), None, threads=2, calls="vector"))
    assert plan == make_plan(PairSpec(str(gguf), None, backend="llama.cpp", threads=2, calls="vector"))
    assert "chose llama.cpp: --calls vector is a llama.cpp setting" in capsys.readouterr().err
    assert choice.candidates("t.gguf", None, "cpu", "batched") == ["llama.cpp"]
    assert choice.candidates("t.gguf", None, "cpu") == ["torch", "llama.cpp"]
    with pytest.raises(SpeculorError, match="--draft-vocab a torch one"):
        speculor.load_pair("t.gguf", "d.gguf", calls="vector", draft_vocab=1024)
    monkeypatch.setattr(choice, "torch_only", lambda target, draft, device: "it is not GGUF")
    with pytest.raises(SpeculorError, match="--calls vector is a llama.cpp setting, and it is not GGUF"):
        speculor.load_pair("/models/t", None, calls="vector")
    with pytest.raises(SpeculorError, match="--calls vector is a llama.cpp setting, and it is not GGUF"):
        choice.candidates("/models/t", None, "cpu", "vector")
