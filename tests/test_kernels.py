"""PackedLinear: the same function as nn.Linear (within fp32 rounding) on each of its kernels, holding no fp32 copy
of the weight; Int8Linear: close to it; pack_linears frees the weights it replaces."""

import gc
import weakref

import pytest
import torch

from speculor.errors import SpeculorError
from speculor.runtime.kernels import PackedLinear, can_pack, is_packed, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("min_rows", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
def test_packed_linear_matches_linear(rows: int, bias: bool, min_rows: int) -> None:
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin, min_rows=min_rows)
    assert not hasattr(packed, "weight")
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        ref, got = lin(x), packed(x)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(48, 80), (96, 40)])
def test_a_rows_output_does_not_depend_on_its_block(shape: tuple[int, int]) -> None:
    """Bitwise: a row alone (padded to min_rows), or inside a block of any size, gets the same output; so plain
    decoding, a verification block and a batch of requests compute a token's logits alike."""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(*shape))
    x = torch.randn(40, shape[0])
    with torch.inference_mode():
        whole = packed(x)
        for n in (1, 2, 4, 5, 6, 16, 17, 33):
            assert torch.equal(packed(x[:n]), whole[:n]), n
        for k in range(0, 40, 7):
            assert torch.equal(packed(x[k:k + 1]), whole[k:k + 1]), k


def test_padding_is_dropped_and_bad_sizes_refused() -> None:
    lin = torch.nn.Linear(8, 3)
    packed = PackedLinear(lin, min_rows=5)
    with torch.inference_mode():
        y = packed(torch.zeros(2, 8))
    assert y.shape == (2, 3)  # the three zero rows added for the kernel are not returned
    torch.testing.assert_close(y, lin.bias.detach().expand(2, 3))
    for rows, min_rows in ((0, 5), (16, 0)):
        with pytest.raises(SpeculorError, match="rows"):
            PackedLinear(torch.nn.Linear(4, 4), rows, min_rows)


def test_pack_linears_frees_the_fp32_weights_and_skips_non_fp32() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        ref = model(x)
    weights = [weakref.ref(model[i].weight) for i in (0, 2)]
    biases = [model[i].bias for i in (0, 2)]
    assert not is_packed(model) and pack_linears(model) == 2 and is_packed(model)
    gc.collect()
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
    assert all(w() is None for w in weights)  # nothing holds the fp32 weights any more
    assert list(model.parameters()) == biases  # the biases are all that is left (shared, not copied)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    half = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(torch.bfloat16)
    assert not can_pack(half) and pack_linears(half) == 0 and not is_packed(half)


def _tiny_qwen2(tie: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_packed_model_holds_each_weight_once_and_gives_the_same_logits(tie: bool) -> None:
    """After packing, the parameters left are the embedding table (the lookup needs it), the norms and the biases;
    every Linear weight but a tied head's (the embedding itself) is freed, and the logits are stock nn.Linear's."""
    model = _tiny_qwen2(tie)
    ids = torch.tensor([[3, 9, 27, 14, 5, 60, 1]])
    with torch.inference_mode():
        ref = model(ids).logits
    embedding = model.get_input_embeddings().weight
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    weights = [weakref.ref(m.weight) for m in linears if m.weight is not embedding]
    assert len(weights) == 2 * 7 + (0 if tie else 1)  # q k v o gate up down per layer, and an untied head
    del linears
    n = pack_linears(model)
    gc.collect()
    assert n == 2 * 7 + 1 and all(w() is None for w in weights)
    left = {name for name, _ in model.named_parameters()}
    assert all(name.endswith(("embed_tokens.weight", "norm.weight", ".bias")) for name in left), left
    fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    biases = 2 * (cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads)
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    assert fp32_bytes == 4 * (embedding.numel() + biases + norms)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_packed_model_gives_the_same_greedy_tokens() -> None:
    from speculor.config import SamplingConfig
    from speculor.drafters.chain import ChainDrafter
    from speculor.engine import stream
    from speculor.runtime.model import Model

    target, draft = _tiny_qwen2(False), _tiny_qwen2(False)
    prompt, sc = [3, 9, 27, 14, 5], SamplingConfig(max_new_tokens=20)
    plain = [t.id for t in stream(Model(target), None, prompt, sc)]
    pack_linears(target)
    pack_linears(draft)
    spec = [t.id for t in stream(Model(target), ChainDrafter(Model(draft), 4), prompt, sc)]
    assert spec == plain


@pytest.mark.parametrize("fbgemm", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_linear_approximates_linear_without_its_weight(rows: int, fbgemm: bool, monkeypatch) -> None:
    from speculor.runtime import kernels
    from speculor.runtime.kernels import Int8Linear

    if not fbgemm:  # the int8pack fallback of a torch without the x86/fbgemm quantized engine
        monkeypatch.setattr(kernels, "_fbgemm_pack", lambda *args: None)
    elif kernels._fbgemm_pack(torch.ones(2, 2, dtype=torch.int8), torch.ones(2), None) is None:
        pytest.skip("no fbgemm engine in this torch")

    torch.manual_seed(rows)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    weight = weakref.ref(model[0].weight)
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        ref = model(x)
        assert pack_linears(model, Int8Linear) == 1
        gc.collect()
        assert weight() is None and not hasattr(model[0], "weight")  # int8 only: the fp32 weight is gone
        assert model[0].kernel == ("fbgemm" if fbgemm else "int8pack")
        got = model(x)
        assert got.shape == ref.shape and got.dtype == torch.float32
        rel = (got - ref).norm() / ref.norm()
        assert 0 < rel < 2e-2  # quantized, so not exact, but close


def test_weights_mapped_from_safetensors_give_their_pages_back(tmp_path) -> None:
    """transformers maps a safetensors file; drop_file_pages unmaps a weight's pages (reading it again faults them
    in from the file, same values) and leaves memory of any other kind alone."""
    from transformers import AutoModelForCausalLM

    from speculor.runtime import memory

    model = _tiny_qwen2(False)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    w = loaded.model.layers[0].mlp.up_proj.weight
    if not memory._in_safetensors_mapping(w.data_ptr(), w.data_ptr() + w.nbytes):
        pytest.skip("this transformers does not map safetensors files")
    assert memory.drop_file_pages(model.model.layers[0].mlp.up_proj.weight) == 0  # anonymous memory: untouched
    big = loaded.get_output_embeddings().weight  # 64 x 32 floats = 2 pages
    assert memory.drop_file_pages(big) >= 4096
    torch.testing.assert_close(big, model.get_output_embeddings().weight, rtol=0, atol=0)
    ids = torch.tensor([[3, 9, 27, 14, 5]])
    with torch.inference_mode():
        ref = model(ids).logits
        assert pack_linears(loaded) == 2 * 7 + 1
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_tied_models_embedding_reads_back_after_packing_drops_its_pages(tmp_path) -> None:
    """pack_linears unmaps a tied head's pages, which are the embedding table's: the lookups fault them in again
    from the file, so the logits stay stock nn.Linear's."""
    from transformers import AutoModelForCausalLM

    from speculor.runtime import memory

    model = _tiny_qwen2(True)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    table = loaded.get_input_embeddings().weight
    if not memory._in_safetensors_mapping(table.data_ptr(), table.data_ptr() + table.nbytes):
        pytest.skip("this transformers does not map safetensors files")
    ids = torch.tensor([[3, 9, 27, 14, 5, 63]])
    with torch.inference_mode():
        ref = model(ids).logits
        assert pack_linears(loaded) == 2 * 7 + 1
        assert loaded.get_input_embeddings().weight is table
        torch.testing.assert_close(table, model.get_input_embeddings().weight, rtol=0, atol=0)
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=1e-5, atol=1e-5)
