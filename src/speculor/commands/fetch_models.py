"""`speculor fetch-models`: download and convert the embedded model pair and the prompt sets."""

from __future__ import annotations

from speculor.commands import Args


def run(args: Args) -> None:
    from speculor.bench import prompts
    from speculor.runtime import embedded

    prompts.fetch()
    for name in embedded.EMBEDDED:
        print(embedded.ensure(name, download=True))
