"""Shared fixtures. The real pair takes ~16 GB of RAM: load it once per session, for every integration module,
and decode the plain greedy references of the shared prompts once."""

import pytest

NEW_TOKENS = 32  # greedy identity is checked over this many new tokens per prompt


@pytest.fixture(scope="session")
def real_pair():
    from speculor import load_pair

    return load_pair()


@pytest.fixture(scope="session")
def real_sp(real_pair):
    from speculor import Speculor

    return Speculor(real_pair, strategy="plain")


@pytest.fixture(scope="session")
def greedy_cases(real_sp) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt ids, plain greedy continuation) for 3 MT-Bench + 3 HumanEval prompts."""
    from speculor import SamplingConfig, prompts

    cfg = SamplingConfig(max_new_tokens=NEW_TOKENS)
    out = []
    for p in prompts.load(["mtbench", "humaneval"], 6):
        ids = real_sp.encode(p.text, chat=p.chat)
        out.append((p.id, ids, real_sp.generate(ids, cfg).token_ids))
    return out
