"""Per-layer storage policies (``transformers.cache_utils.CacheLayerMixin`` subclasses), one policy per module."""

from .quantized import QuantizedLayer, QuantizedSlidingWindowLayer

__all__ = ["QuantizedLayer", "QuantizedSlidingWindowLayer"]
