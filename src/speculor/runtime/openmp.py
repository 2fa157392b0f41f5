"""The OpenMP threads under the CPU kernels: `release()` gives the calling thread's team back.

ggml's CPU backend computes a graph in one OpenMP team and meets at an OpenMP barrier after every op (hundreds a
token); torch's intra-op parallelism runs in OpenMP teams too. One libgomp serves both in a process (torch's bundled
copy and llama.cpp's dependency have one soname: the first loaded is the one). It keeps a team for every thread that
ever started one, and once the teams' threads outnumber the cores it spins only briefly at a barrier before sleeping
on a futex. A thread that decodes after another has decoded (a server's worker after the thread that loaded and
warmed the models) then pays a wake-up at every op, a slower token (measured in docs/bench/cpu-room/openmp/). A
thread that hands decoding to another calls `release()` when it is done; its team comes back (one thread made) if it
computes again.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime stays usable


def release() -> bool:
    """End the calling thread's OpenMP team (OpenMP 5.0's omp_pause_resource_all): whether libgomp did. Another
    OpenMP runtime, or none: nothing to release."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the one loaded (found by its soname), else an unused one
    except OSError:
        return False
    pause = getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
