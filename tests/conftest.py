"""Shared fixtures. The real pair takes ~7 GiB of RAM: load it once per session, for every integration module,
and decode the plain greedy references of the shared prompts once."""

import pytest

NEW_TOKENS = 32  # greedy identity is checked over this many new tokens per prompt


@pytest.fixture(scope="session")
def real_pair():
    from speculor import load_pair

    return load_pair(backend="torch")  # the fp32 reference the integration tests check against


@pytest.fixture(scope="session")
def real_sp(real_pair):
    from speculor import Speculor

    return Speculor(real_pair, strategy="plain")


@pytest.fixture(scope="session")
def greedy_cases(real_sp) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt ids, plain greedy continuation) for 3 MT-Bench + 3 HumanEval prompts."""
    from speculor import SamplingConfig
    from speculor.bench import prompts

    cfg = SamplingConfig(max_new_tokens=NEW_TOKENS)
    out = []
    for p in prompts.load(["mtbench", "humaneval"], 6):
        ids = real_sp.encode(p.text, chat=p.chat)
        out.append((p.id, ids, real_sp.generate(ids, cfg).token_ids))
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny tensors, where threads only add overhead on a shared machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    """The toy target of the toy-LM modules (modules with transformers models define their own or import
    support.tiny's)."""
    from support.toy import random_toy

    return random_toy(6, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """Close enough to the toy target that runs of 0, 1 and 2 accepted tokens (and bonus tokens) all occur."""
    from support.toy import perturbed

    return perturbed(target, seed=1, noise=0.8)
