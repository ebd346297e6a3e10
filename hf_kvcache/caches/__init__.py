"""Public cache classes: thin ``transformers.Cache`` subclasses that assemble per-layer storage from a config, one
module per cache, each registering its spec strings (:mod:`hf_kvcache.registry`) where it is defined."""

from ._base import KVCacheReportMixin, load_cache

# isort: off
# Import order is registration order, which `hf-kvcache list` shows: quantized, sliding window, paged.
from .quantized import QuantizedKVCache
from .sliding import SlidingWindowKVCache
from .paged import PagedKVCache

# isort: on

__all__ = ["KVCacheReportMixin", "PagedKVCache", "QuantizedKVCache", "SlidingWindowKVCache", "load_cache"]
