"""The decoding loop (`loop.py`): one step = propose a draft tree, one target forward over it, verify, commit."""

from speculor.engine.loop import Request, Stats, Step, Token, check_prompt, start, stream

__all__ = ["Request", "Stats", "Step", "Token", "check_prompt", "start", "stream"]
