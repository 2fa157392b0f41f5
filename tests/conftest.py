"""Shared fixtures. The real pair takes ~16 GB of RAM: load it once per session, for every integration module."""

import pytest


@pytest.fixture(scope="session")
def real_pair():
    from speculor import load_pair

    return load_pair()
