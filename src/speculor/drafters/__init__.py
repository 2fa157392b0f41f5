"""Drafters (per request) and strategies (per pair, shared): the shared base, one module per strategy, the registry."""
