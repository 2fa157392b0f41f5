"""Drafters (per request) and strategies (per pair, shared): the shared base and drafters, one module per strategy,
the registry."""
