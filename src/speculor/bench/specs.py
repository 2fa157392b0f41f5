"""Strategy specs of `speculor bench`: "plain,chain:k=2,sequoia:budget=auto" -> [Spec, ...]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speculor.errors import SpeculorError


@dataclass(frozen=True)
class Spec:
    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_strategies(text: str) -> list[Spec]:
    """'plain,chain:k=2' -> [Spec('plain','plain',{}), Spec('chain:k=2','chain',{'k': 2})]; plain comes first.
    llama-server's rows name a configuration after the colon ('llama-server:ngram-mod', 'llama-server:all': one
    row each; bench/peer_server.py), a Spec whose name is its label."""
    from speculor.bench import peer_server

    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, *opts = item.split(":")
        if name == peer_server.SERVER:
            labels = map(peer_server.label, peer_server.parse_peers(item))
            specs += [Spec(label, label) for label in labels if label not in {s.label for s in specs}]
            continue
        options = {}
        for o in opts:
            key, sep, value = o.partition("=")
            if not sep:
                raise SpeculorError(f"bad strategy option {o!r} in {item!r}; write key=value")
            options[key.replace("-", "_")] = _number(value)
        specs.append(Spec(item, name, options))
    specs = [s for s in specs if s.name == "plain"][:1] + [s for s in specs if s.name != "plain"]
    if not specs or specs[0].name != "plain":
        specs.insert(0, Spec("plain", "plain"))
    return specs


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value
