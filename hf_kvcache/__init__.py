"""hf_kvcache: KV caches for Hugging Face transformers' ``generate()``, and the evidence to choose between them."""

import warnings as _warnings

import transformers as _transformers

from ._compat import untested_release as _untested_release
from ._version import __version__
from .attention import ATTENTION, register_attention
from .caches import PagedKVCache, QuantizedKVCache, SlidingWindowKVCache, load_cache
from .memory import cache_nbytes, dynamic_bytes_per_token
from .models import default_model, load_model, load_reference_model, model_path
from .reference import reference_model_path, reference_text
from .registry import available_caches, make_cache, parse_spec, register_cache

register_attention()  # attn_implementation="hf_kvcache" works once hf_kvcache is imported

if (_message := _untested_release(_transformers.__version__)) is not None:
    _warnings.warn(_message, UserWarning, stacklevel=2)

__all__ = [
    "ATTENTION",
    "PagedKVCache",
    "QuantizedKVCache",
    "SlidingWindowKVCache",
    "available_caches",
    "cache_nbytes",
    "default_model",
    "dynamic_bytes_per_token",
    "load_cache",
    "load_model",
    "load_reference_model",
    "make_cache",
    "model_path",
    "parse_spec",
    "reference_model_path",
    "reference_text",
    "register_cache",
    "__version__",
]
