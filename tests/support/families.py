"""Tiny random models of every architecture family the engine supports (fp32, CPU, no download), for the
architecture matrix: `family_model(name)` builds one; `FAMILIES` names them, sliding-window variants included."""

from __future__ import annotations

import torch
import transformers

VOCAB = 64
WINDOW = 8  # the sliding window of the windowed variants: the tests decode well past it

# name -> (config class, model class, config fields beside the common ones)
_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 8, "sliding_window": WINDOW, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                 "logits_scaling": 4.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
FAMILIES = tuple(_SPECS)


def family_model(name: str, seed: int = 0, *, layers: int = 3, hidden: int = 32, vocab: int = VOCAB,
                 context: int = 256):
    """A random model of family `name` (FAMILIES) in fp32, eval mode, sdpa attention where the family has it."""
    config_cls, model_cls, extra = _SPECS[name]
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=context,
                  eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    fields.update(extra)
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**fields)
    return getattr(transformers, model_cls)(config).float().eval()
