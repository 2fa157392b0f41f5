"""speculor: lossless speculative decoding with token trees and graphs."""

from speculor.api import Generation, Speculor
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.models import LM, Pair, load_pair
from speculor.tree import DraftTree

__all__ = ["DraftTree", "Generation", "LM", "Pair", "SamplingConfig", "Speculor", "SpeculorError", "load_pair"]
__version__ = "0.1.0"
