"""Models and what they run on: the shared Model, the per-request KVCache, loading, kernels, the cost curve, assets."""
