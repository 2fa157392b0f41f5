"""runtime/openmp.py: release() ends the calling thread's OpenMP team (the one libgomp that torch's and llama.cpp's
kernels share); tests/test_llama.py checks it after a llama.cpp decode, with the bits of the next one."""

from __future__ import annotations

import os

import torch

from speculor.runtime import openmp


def tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def test_release_ends_the_calling_threads_team():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).exp_()  # a parallel op in this thread: its team of 2 (one worker thread)
        before = tasks()
        assert openmp.release(), "torch's kernels here run on libgomp"
        assert tasks() == before - 1
        torch.ones(1 << 22).exp_()  # the team made again
        assert tasks() == before
    finally:
        torch.set_num_threads(threads)
