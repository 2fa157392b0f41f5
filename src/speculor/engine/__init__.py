"""The engine: a request's types (request.py), its part of a step (steps.py), the single-stream driver (loop.py),
the batched step (batch.py) and the step's drafting (drafting.py)."""

from speculor.engine.loop import stream
from speculor.engine.request import Request, Stats, Step, Token, check_prompt
from speculor.engine.steps import start

__all__ = ["Request", "Stats", "Step", "Token", "check_prompt", "start", "stream"]
