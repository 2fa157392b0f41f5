"""speculor: lossless speculative decoding with token trees and graphs.

The names below are imported on first use (PEP 562), so `import speculor` and `speculor --help` do not load
torch or transformers.
"""

from importlib import import_module

__all__ = ["DraftTree", "Generation", "KVCache", "Model", "Pair", "PairSpec", "SamplingConfig", "Speculor",
           "SpeculorError", "load_pair"]
__version__ = "0.1.0"

_WHERE = {"Generation": "speculor.api", "Speculor": "speculor.api", "SamplingConfig": "speculor.config",
          "SpeculorError": "speculor.errors", "Model": "speculor.runtime.model", "KVCache": "speculor.runtime.cache",
          "Pair": "speculor.runtime.backend", "PairSpec": "speculor.runtime.spec",
          "load_pair": "speculor.runtime.loading",  # resolve, prepare, load
          "DraftTree": "speculor.core.tree"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'speculor' has no attribute {name!r}")
