"""The OpenMP threads under llama.cpp's CPU kernels: `release()` gives the calling thread's team back.

ggml's CPU backend computes a graph in one OpenMP team and meets at an OpenMP barrier after every op (hundreds a
token). libgomp (one runtime per process: torch's and llama.cpp's are the same library) keeps a team for every
thread that ever started one, and once the teams' threads outnumber the cores it spins only ~100 times at a barrier
before sleeping on a futex. A thread that decodes after another has decoded (a server's worker after the thread that
loaded and warmed the models) then pays a wake-up at every op: on two cores with two threads, 1.2-1.4x the time per
token (docs/bench/cpu-room/openmp/). A thread that hands decoding to another calls `release()` when it is done; its
team comes back (one thread made) if it computes again.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime stays usable


def release() -> bool:
    """End the calling thread's OpenMP team (OpenMP 5.0's omp_pause_resource_all): whether the runtime that
    llama.cpp's kernels use did. No llama.cpp, or kernels without OpenMP: nothing to release."""
    from speculor.runtime import llama

    if not llama.available():
        return False
    libllama = llama._lib().llama_cpp._lib  # its symbols and its dependencies': libgomp's where ggml uses OpenMP
    pause = getattr(libllama, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
