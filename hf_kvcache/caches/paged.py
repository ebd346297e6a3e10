"""``PagedKVCache``: K/V in blocks of a pool with per-row block tables; registers the ``paged`` cache kind."""

from __future__ import annotations

from functools import partial

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .._config import LayerSpec
from .._validate import check_int
from ..layers.paged import PagedLayer, PagedState, page_bytes_per_token
from ..layers.state import cache_layer
from ..layers.window import ModelSlidingWindowLayer
from ..registry import register_cache
from ._base import KVCacheReportMixin, PaddingObserverMixin, split_model

__all__ = ["PagedKVCache"]


class PagedKVCache(PaddingObserverMixin, KVCacheReportMixin, Cache):
    """K/V in fixed-size blocks of a pool with per-row block tables, inside ``generate()`` (PagedAttention,
    https://arxiv.org/abs/2309.06180).

    Rows that ``num_return_sequences`` or ``num_beams`` create from one prompt store that prompt once (shared blocks
    with reference counts); a row that writes into a shared, partly filled block copies it first (copy-on-write).
    Beam search reorders block tables instead of copying K/V, and finished rows release their blocks. Lossless:
    outputs equal ``DynamicCache``'s. The model's own sliding-window layers (hybrid models) keep a plain window, as
    ``DynamicCache`` does.

    Left padding: built from a model, the cache reads each row's padding from the attention mask (one shared hook per
    model, only forwards passed this cache) and stores no block that holds only a row's left padding; built from a
    config, call ``cache.padding.observe(attention_mask)`` before prefilling a left-padded batch, or padding is
    stored like any token (as ``DynamicCache`` does).

    Attention: with any attention implementation (eager, sdpa, ...) each forward gathers the rows' blocks into
    contiguous K/V. Under the ``hf_kvcache`` attention implementation (``model.set_attn_implementation(
    "hf_kvcache")``) attention reads the blocks through the block tables instead, without that copy.

    Lifecycle: the block tables take their batch size from the first forward; a forward that does not match raises
    ``ValueError``; ``reset()`` frees every block and the pool's storage, so the next forward may bring any batch
    size, dtype and device. A dropped cache frees its pool at once (no reference cycles).

    Args:
        config: the model's ``PretrainedConfig``, or the model itself (recommended: left padding is then not stored).
        block_size: token slots per block, >= 1.
        num_blocks: None grows the pool on demand (geometrically; block ids never change); an integer preallocates a
            fixed pool of that many blocks (one block holds ``block_size`` tokens of every full-attention layer).
            Running out raises ``PoolExhaustedError`` (a ``RuntimeError``) that says how many blocks to allow,
            and leaves the cache as it was.
        grow_blocks: smallest growth step of an on-demand pool.
        bits: None (pages in the model's dtype, lossless) or 8: int8 pages with one float32 scale per token and head,
            as :class:`~hf_kvcache.QuantizedKVCache` ``bits=8`` encodes them (about half the pool of bf16 pages for
            the same tokens; the model's own sliding layers stay in full precision).

    Example:
        >>> from transformers import LlamaConfig
        >>> from hf_kvcache import PagedKVCache
        >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> cache = PagedKVCache(config, block_size=16, num_blocks=128)
        >>> cache.block_report()["num_blocks"]
        128
    """

    def __init__(
        self,
        config: PretrainedConfig | torch.nn.Module,
        block_size: int = 16,
        num_blocks: int | None = None,
        grow_blocks: int = 64,
        bits: int | None = None,
    ):
        model, config = split_model(config)
        check_int("block_size", block_size, 1)
        if num_blocks is not None:
            check_int("num_blocks", num_blocks, 1)
        check_int("grow_blocks", grow_blocks, 1)
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or bits != 8):
            raise ValueError(f"bits must be None (pages in the model's dtype) or 8 (int8 pages), got {bits!r}")
        specs = self._bind_model(model, config)
        self.block_size, self.num_blocks, self.grow_blocks, self.bits = block_size, num_blocks, grow_blocks, bits
        self.state = PagedState(block_size, num_blocks, grow_blocks, self.padding, bits)
        owner, layers, rank = type(self).__name__, [], 0
        for i, spec in enumerate(specs):
            if spec.layer_type == "full_attention":
                paged = partial(PagedLayer, spec, i, owner, self.state, rank, self.attention_mode)
                layers.append(cache_layer(spec, i, owner, paged))
                rank += 1
            else:  # the model's own sliding layers in full precision; a hybrid's recurrent layers
                layers.append(cache_layer(spec, i, owner, partial(ModelSlidingWindowLayer, spec, i, owner)))
        super().__init__(layers=layers)
        self._observe_model(model)

    def _keeps_tensors(self, spec: LayerSpec) -> bool:
        return spec.layer_type != "full_attention"  # the model's own sliding layers: ModelSlidingWindowLayer

    def block_report(self) -> dict:
        """Pool size, blocks used / free / shared, allocated slots and waste: the fraction of allocated slots past
        each row's last token (the unused tail of its last block). Padding slots of a stored block count as filled."""
        return self.state.report()

    def memory_report(self) -> dict:
        return super().memory_report() | {"blocks": self.block_report()}

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` with the broken state if the pool and the block tables disagree."""
        self.state.allocator.check_invariants(self.state.tables.tables)

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Stored bytes per distinct token (a shared prompt block counts once), summed over layers. The model's own
        sliding layers keep full precision, as with ``bits=None``."""
        bits = {"full_attention": self.bits}
        return sum(page_bytes_per_token(s, bits.get(s.layer_type), dtype) for s in self.layer_specs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, num_blocks={self.num_blocks}, bits={self.bits}, "
            f"layers={len(self.layers)})"
        )


register_cache("paged", "PagedKVCache: block pool + block tables, shared prompt blocks, copy-on-write (bits=8: int8)")(
    PagedKVCache
)
