"""The benchmark harness (against plain decoding and transformers' peers), prompt sets, plots and the load test."""
