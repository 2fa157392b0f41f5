"""What each attention layer of a transformers causal LM sees, read from its config, and the models the engine
refuses because a token tree cannot be verified through them exactly.

A layer sees the whole context (window None) or a sliding window of w positions: key k is visible from query q iff
pos(q) - pos(k) < w (transformers' `sliding_window_overlay`). Models list their layers in `config.layer_types`
("full_attention" / "sliding_attention", Gemma 2/3, Qwen2/3, ...) or give one `sliding_window` for every layer
(Mistral, Mixtral, Phi-3; None = full). Recurrent and linear-attention layers keep a state that a tree's branches
would share, so such models are refused by name when loading.
"""

from __future__ import annotations

from speculor.errors import SpeculorError

FULL, SLIDING = "full_attention", "sliding_attention"
# families whose layers keep a recurrent / convolutional state (or mix them with attention): no tree verification
RECURRENT = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next", "xlstm", "minimax",
    "plamo2", "hunyuan_v1_moe_hybrid", "kimi_linear", "olmo3_next",
})


def layer_windows(config) -> tuple[int | None, ...]:
    """The window of every decoder layer (None: full attention); a clear error for a model that cannot be run."""
    kind = getattr(config, "model_type", "?")
    if kind in RECURRENT:
        raise SpeculorError(f"model type {kind!r} has recurrent or linear-attention layers: their state cannot branch "
                            "over a draft tree, so speculor cannot verify it exactly")
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise SpeculorError(f"model type {kind!r} is not a decoder-only attention model speculor can run")
    types = getattr(config, "layer_types", None)
    if types is None:
        return (getattr(config, "sliding_window", None) or None,) * n
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        raise SpeculorError(f"model type {kind!r} has layers of type {', '.join(other)}: speculor verifies trees "
                            f"through {FULL} and {SLIDING} layers only")
    return tuple(config.sliding_window if t == SLIDING else None for t in types)
