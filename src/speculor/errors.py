"""The one exception type speculor raises for bad input or missing assets (shown to users as is)."""


class SpeculorError(ValueError):
    """A clear, user-facing error: bad input, a missing or corrupt asset, incompatible models."""
