"""PackedLinear: the same function as nn.Linear (within fp32 rounding) on each of its kernels."""

import pytest
import torch

from speculor.runtime.kernels import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
def test_packed_linear_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        ref, got = lin(x), packed(x)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pack_linears_keeps_parameters_and_skips_non_fp32() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    params = [p.data_ptr() for p in model.parameters()]
    assert pack_linears(model) == 2
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
    assert [p.data_ptr() for p in model.parameters()] == params
    half = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(torch.bfloat16)
    assert not can_pack(half) and pack_linears(half) == 0


def test_packed_model_gives_the_same_greedy_tokens() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from speculor.config import SamplingConfig
    from speculor.drafters.base import ChainDrafter
    from speculor.engine import stream
    from speculor.runtime.model import Model

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    target, draft = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    prompt, sc = [3, 9, 27, 14, 5], SamplingConfig(max_new_tokens=20)
    plain = [t.id for t in stream(Model(target), None, prompt, sc)]
    pack_linears(target)
    pack_linears(draft)
    spec = [t.id for t in stream(Model(target), ChainDrafter(Model(draft), 4), prompt, sc)]
    assert spec == plain


@pytest.mark.parametrize("fbgemm", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_linear_approximates_linear_and_eager_restores_it(rows: int, fbgemm: bool, monkeypatch) -> None:
    from speculor.runtime import kernels
    from speculor.runtime.kernels import Int8Linear, eager

    if not fbgemm:  # the int8pack fallback of a torch without the x86/fbgemm quantized engine
        monkeypatch.setattr(kernels, "_fbgemm_pack", lambda *args: None)
    elif kernels._fbgemm_pack(torch.ones(2, 2, dtype=torch.int8), torch.ones(2), None) is None:
        pytest.skip("no fbgemm engine in this torch")

    torch.manual_seed(rows)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    ref_lin = model[0]
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        ref = ref_lin(x)
        assert pack_linears(model, Int8Linear) == 1
        assert model[0].kernel == ("fbgemm" if fbgemm else "int8pack")
        got = model(x)
        assert got.shape == ref.shape and got.dtype == torch.float32
        rel = (got - ref).norm() / ref.norm()
        assert 0 < rel < 2e-2  # quantized, so not exact, but close
        with eager(model):
            assert torch.equal(model(x), ref)
        assert torch.equal(model(x), got)  # switched back on after the block
