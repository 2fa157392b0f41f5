"""The first stage: a `PairSpec` resolved to a frozen `Plan` (runtime/plan.py): what to load and which backend.

Contract: `resolve(spec)` chooses the backend "auto" stands for (runtime/choice.py: from this machine's cached cost
measurement, measured once where none is cached; said on stderr), then makes the plan of that backend
(`make_plan`: the options checked, each model spec located, no file fetched or model loaded). Any other backend is
kept. The other stages take the plan as it is: runtime/prepare.py, then runtime/load.py.
"""

from __future__ import annotations

from dataclasses import replace

from speculor.runtime.choice import choose_backend
from speculor.runtime.plan import Plan, make_plan
from speculor.runtime.spec import PairSpec


def resolve(spec: PairSpec) -> Plan:
    """The plan of `spec`, its backend concrete."""
    if spec.backend == "auto":
        spec = replace(spec, backend=choose_backend(spec))
    return make_plan(spec)
