"""pykv: a llama.cpp-style GGUF inference runtime with KV-cache eviction policies."""
from . import _checkout
from ._ffi import ffi, lib
from .errors import (BackendError, ContextOverflowError, InvalidArgumentError, ModelLoadError,
                     PykvError)
from ._sampling import TokenLogprob
from ._state import LlamaState
from .caches import BaseLlamaCache, LlamaDiskCache, LlamaRAMCache
from .grammar import LlamaGrammar
from .llama import GenerationChunk, GenerationResult, Llama
from .policies import list_policies
from .processors import LogitsProcessorList, StoppingCriteriaList

__version__ = "0.1.0"

_checkout.install_converter_finder()


def system_info() -> str:
    """CPU features and kernels the native library uses."""
    return ffi.string(lib.pykv_system_info()).decode()


__all__ = ["Llama", "GenerationChunk", "GenerationResult", "TokenLogprob", "LlamaState", "LlamaRAMCache", "LlamaDiskCache", "BaseLlamaCache", "LlamaGrammar",
           "LogitsProcessorList", "StoppingCriteriaList", "PykvError", "ModelLoadError", "ContextOverflowError",
           "InvalidArgumentError", "BackendError", "system_info", "list_policies", "__version__"]
