"""The OpenAI-compatible HTTP server (see `speculor.serving.app`): `create_app(pair)` and `serve(pair)`; on Ray Serve:
`speculor.serving.ray_serve`.

Both are imported on first use (PEP 562), so importing a submodule such as `schemas` does not load the app.
"""

__all__ = ["create_app", "serve"]


def __getattr__(name: str):
    if name in __all__:
        from speculor.serving import app

        return getattr(app, name)
    raise AttributeError(f"module 'speculor.serving' has no attribute {name!r}")
