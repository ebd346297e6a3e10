"""Public cache classes: thin ``transformers.Cache`` subclasses that assemble per-layer storage from a config."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from . import quant
from ._config import LayerSpec, layer_specs, resolve_config
from .layers._codecs import Int8Codec, KiviCodec
from .layers._common import PaddingTracker
from .layers._storage import Workspace, _nbytes
from .layers.paged import PagedLayer, PagedState
from .layers.quantized import QuantizedLayer, QuantizedSlidingWindowLayer
from .layers.sliding import QuantizedCodecAdapter, SinkWindowLayer
from .rope import rotary_spec

__all__ = ["KVCacheReportMixin", "PagedKVCache", "QuantizedKVCache", "SlidingWindowKVCache"]

_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BACKENDS = ("torch", "bitsandbytes")
_DEFAULT_RESIDUAL = {8: 0, 4: 128, 2: 128}


class KVCacheReportMixin:
    """Memory reporting shared by the hf_kvcache caches (layers expose ``nbytes`` / ``reserved_nbytes``)."""

    layers: list

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage holding live tokens now: data, scales, zero points, residual, block tables."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated now, including growth headroom (``>= nbytes``)."""
        return sum(layer.reserved_nbytes for layer in self.layers)

    def memory_report(self) -> dict:
        """Totals and a per-layer breakdown (``layer_idx``, ``type``, ``stored_tokens``, ``nbytes``, ...)."""
        rows = [
            {
                "layer_idx": i,
                "type": type(layer).__name__,
                "seen_tokens": layer.get_seq_length(),
                "stored_tokens": layer.stored_tokens,
                "nbytes": layer.nbytes,
                "reserved_nbytes": layer.reserved_nbytes,
            }
            for i, layer in enumerate(self.layers)
        ]
        return {
            "nbytes": self.nbytes,
            "reserved_nbytes": self.reserved_nbytes,
            "workspace_nbytes": self.workspace_nbytes,
            "layers": rows,
        }

    @property
    def workspace_nbytes(self) -> int:
        """Scratch shared by all layers for the K/V handed to attention (one layer's worth, not per layer)."""
        workspace = getattr(self, "workspace", None)
        return workspace.nbytes if workspace is not None else 0


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class QuantizedKVCache(KVCacheReportMixin, Cache):
    """A KV cache that stores keys and values in 8, 4 or 2 bits, for any ``generate()`` mode.

    * ``bits=8`` (default): symmetric absmax int8 with one float32 scale per token, head and ``group_size``
      channels (the whole head by default), about 0.52x of a bf16 cache at head_dim 128. Each token is encoded as it
      arrives; greedy decoding keeps the tokens of the default cache in our tests.
    * ``bits=4`` / ``bits=2``: KIVI (https://arxiv.org/abs/2402.02750): keys quantized per channel over groups of
      ``group_size`` tokens, values per token over groups of ``group_size`` channels, asymmetric (scale + zero point),
      packed 2 or 4 codes per byte, with the most recent ``residual_length`` tokens kept in full precision.

    Every token is encoded exactly once (the prompt's tail stays in the residual; nothing is re-quantized), appends
    are amortized, and the K/V handed to attention are decoded into one workspace shared by all layers. On hybrid
    models the model's sliding-window layers are quantized too and keep only their window, as ``DynamicCache`` does.
    Non-finite values never poison a group (see :mod:`hf_kvcache.quant`).

    Args:
        config: the model's ``PretrainedConfig``, or the model itself.
        bits: 8, 4 or 2.
        group_size: elements that share a scale. 8 bits: channels per scale group (default: ``head_dim``, one scale
            per token and head). 4/2 bits: tokens per key group and channels per value group (default: the largest
            of 64, 32, 16, 8, 4, 2, 1 that divides ``head_dim``). Must divide ``head_dim``.
        residual_length: most recent tokens kept in full precision (default 0 at 8 bits, 128 at 4 and 2 bits, as in
            KIVI). Tokens leave the residual ``group_size`` at a time at 4/2 bits, so it holds between
            ``residual_length`` and ``residual_length + group_size - 1`` tokens once full.
        backend: ``"torch"`` or, for 8 bits, ``"bitsandbytes"`` (codes from ``bitsandbytes.functional.
            int8_vectorwise_quant``; needs the ``bnb`` extra).
        scale_dtype: dtype of scales and zero points: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or the torch
            dtype). Default: float32 at 8 bits; at 4/2 bits the K/V dtype when it is 16-bit, else float32.

    Example:
        >>> from transformers import LlamaConfig
        >>> from hf_kvcache import QuantizedKVCache
        >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> cache = QuantizedKVCache(config, bits=4, residual_length=32)
        >>> cache.bits, cache.group_size
        (4, 16)
    """

    def __init__(
        self,
        config: PretrainedConfig | torch.nn.Module,
        bits: int = 8,
        group_size: int | None = None,
        residual_length: int | None = None,
        backend: str = "torch",
        scale_dtype: str | torch.dtype | None = None,
    ):
        config = resolve_config(config)
        if bits not in quant.SUPPORTED_BITS or isinstance(bits, bool):
            raise ValueError(f"bits must be one of {quant.SUPPORTED_BITS}, got {bits!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "bitsandbytes":
            if bits != 8:
                raise ValueError(f"backend='bitsandbytes' supports bits=8 only, got bits={bits}")
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as err:
                raise ImportError("backend='bitsandbytes' needs bitsandbytes: pip install 'hf-kvcache[bnb]'") from err
        specs = layer_specs(config, type(self).__name__)
        head_dims = sorted({s.head_dim for s in specs})
        if group_size is None:
            group_size = (
                head_dims[0] if bits == 8 else next(g for g in (64, 32, 16, 8, 4, 2, 1) if head_dims[0] % g == 0)
            )
        _check_int("group_size", group_size, 1)
        if any(d % group_size for d in head_dims) or any(d % (8 // bits) for d in head_dims):
            raise ValueError(f"group_size must divide head_dim ({head_dims[0]}), got {group_size}")
        residual_length = _DEFAULT_RESIDUAL[bits] if residual_length is None else residual_length
        _check_int("residual_length", residual_length, 0)
        if isinstance(scale_dtype, str):
            if scale_dtype not in _SCALE_DTYPES:
                raise ValueError(f"scale_dtype must be one of {tuple(_SCALE_DTYPES)}, got {scale_dtype!r}")
            scale_dtype = _SCALE_DTYPES[scale_dtype]
        elif scale_dtype is not None and scale_dtype not in _SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype must be one of {tuple(_SCALE_DTYPES)}, got {scale_dtype!r}")

        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self.backend, self.scale_dtype = backend, scale_dtype
        self.layer_specs = specs
        self.workspace = Workspace()
        super().__init__(layers=[self._make_layer(spec) for spec in specs])

    def _codec(self):
        if self.bits == 8:
            return Int8Codec(self.group_size, self.scale_dtype or torch.float32, self.backend)
        return KiviCodec(self.bits, self.group_size, self.scale_dtype)

    def _make_layer(self, spec: LayerSpec) -> QuantizedLayer:
        if spec.layer_type == "full_attention":
            return QuantizedLayer(self._codec(), self.residual_length, self.workspace)
        return QuantizedSlidingWindowLayer(self._codec(), self.residual_length, self.workspace, spec.sliding_window)

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Analytic stored bytes per quantized token, summed over layers, for K/V of ``dtype``.

        Excludes the constant-size residual; sliding layers stop growing once their window is full.
        """
        total = 0.0
        for spec, layer in zip(self.layer_specs, self.layers):
            codec = layer.codec
            if codec.scale_dtype is None:  # KIVI "auto": follows the K/V dtype when it is 16-bit
                codec = KiviCodec(self.bits, self.group_size, dtype if dtype.itemsize == 2 else torch.float32)
            total += codec.bytes_per_token(spec.num_kv_heads, spec.head_dim)
        return total

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(bits={self.bits}, group_size={self.group_size}, "
            f"residual_length={self.residual_length}, backend={self.backend!r}, layers={len(self.layers)})"
        )


class SlidingWindowKVCache(KVCacheReportMixin, Cache):
    """Bounded memory for any decoder: attention sinks plus a sliding window (StreamingLLM,
    https://arxiv.org/abs/2309.17453).

    On the model's full-attention layers, a decoding token attends to the first ``sinks`` tokens of its row, the last
    ``window`` tokens before it, and itself; each layer stores at most ``sinks + window`` tokens, so memory stays flat
    however long generation runs. A multi-token forward (prefill) attends to what is stored plus its own tokens under
    the model's causal mask, and eviction happens after it. The model's own sliding-window layers (Gemma 2/3,
    Mistral) keep their own window, exactly as ``DynamicCache`` does.

    Positions: cached keys keep the RoPE rotation of their original position. With ``rerotate=True`` the sink keys
    handed to attention are rotated to sit right before the window (StreamingLLM's position shift), so every
    query-key distance stays within ``sinks + window``. The rotation is read from the model's rotary embedding
    (standard, partial, interleaved, scaled frequencies, attention scaling); length-dependent RoPE (``dynamic``,
    ``longrope``) is refused at construction. Models without RoPE (learned absolute positions, ALiBi) get
    ``rerotate=False`` semantics: their cached keys carry no rotation to change, and positions past a learned
    position table still fail in the model, as without a cache.

    Left padding: a row's sinks are its first real tokens. The cache learns each row's padding from the attention
    mask: built from a model, it hooks the model's forward (only forwards passed this cache); built from a config,
    call ``cache.padding.observe(attention_mask)`` before generating a left-padded batch, or rows count as unpadded.

    Assisted and prompt-lookup decoding work after eviction has begun: while ``generate()`` records the past,
    eviction waits for its ``crop``; a crop that needs evicted tokens raises ``ValueError``.

    Args:
        config: the model's ``PretrainedConfig``, or the model itself (recommended: padding is then tracked).
        window: recent tokens kept per layer, >= 1.
        sinks: first tokens kept per row, >= 0 (0 gives a plain window).
        rerotate: re-rotate the sinks to sit right before the window.
        bits: None (full precision) or 8: int8 storage through the quantized cache's int8 codec (one scale per token
            and head), about half the bytes, still flat.

    Example:
        >>> from transformers import LlamaConfig
        >>> from hf_kvcache import SlidingWindowKVCache
        >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> cache = SlidingWindowKVCache(config, window=256, sinks=4)
        >>> cache.window, cache.sinks, cache.max_stored_tokens
        (256, 4, 260)
    """

    def __init__(
        self,
        config: PretrainedConfig | torch.nn.Module,
        window: int = 1024,
        sinks: int = 4,
        rerotate: bool = True,
        bits: int | None = None,
    ):
        model = config if isinstance(config, torch.nn.Module) else None
        config = resolve_config(config)
        _check_int("window", window, 1)
        _check_int("sinks", sinks, 0)
        if not isinstance(rerotate, bool):
            raise ValueError(f"rerotate must be True or False, got {rerotate!r}")
        if bits is not None and (isinstance(bits, bool) or bits != 8):
            raise ValueError(
                f"bits must be None (full precision) or 8, got {bits!r}: 4- and 2-bit keys are quantized in groups "
                "of tokens, which a window that evicts one token at a time cannot keep"
            )
        specs = layer_specs(config, type(self).__name__)
        self.window, self.sinks, self.rerotate, self.bits = window, sinks, rerotate, bits
        self.layer_specs = specs
        self.padding = PaddingTracker()
        self.workspace = Workspace()
        self.rotary = None
        if rerotate and sinks and any(s.layer_type == "full_attention" for s in specs):
            self.rotary = rotary_spec(model if model is not None else config, config, "full_attention")
        super().__init__(layers=[self._make_layer(spec) for spec in specs])
        if model is not None:
            self.padding.attach(model, self)

    @property
    def max_stored_tokens(self) -> int:
        """Most tokens a full-attention layer stores: ``sinks + window``."""
        return self.sinks + self.window

    @property
    def stored_tokens(self) -> int:
        """Tokens a full-attention layer stores now (every full layer stores the same; at most ``sinks + window``).

        ``get_seq_length()`` counts the tokens *seen*, which positions need; this counts what is kept."""
        full = [layer for layer, s in zip(self.layers, self.layer_specs) if s.layer_type == "full_attention"]
        return full[0].stored_tokens if full else max((layer.stored_tokens for layer in self.layers), default=0)

    def _make_layer(self, spec: LayerSpec):
        int8 = Int8Codec(spec.head_dim, torch.float32) if self.bits == 8 else None
        if spec.layer_type == "full_attention":
            codec = QuantizedCodecAdapter(int8) if int8 is not None else None
            return SinkWindowLayer(self.window, self.sinks, self.rotary, self.padding, codec, self.workspace)
        if int8 is not None:
            return QuantizedSlidingWindowLayer(int8, 0, self.workspace, spec.sliding_window)
        return _SlidingWindowLayer(spec.sliding_window)

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Stored bytes per token, summed over layers, while the window is filling (it stops at the cap)."""
        total = 0.0
        for spec in self.layer_specs:
            if self.bits == 8:
                total += Int8Codec(spec.head_dim, torch.float32).bytes_per_token(spec.num_kv_heads, spec.head_dim)
            else:
                total += 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize
        return total

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(window={self.window}, sinks={self.sinks}, rerotate={self.rerotate}, "
            f"bits={self.bits}, layers={len(self.layers)})"
        )


class _SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding layer with the reporting our caches expose."""

    @property
    def stored_tokens(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return _nbytes(self.keys) + _nbytes(self.values)

    @property
    def reserved_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()


class PagedKVCache(KVCacheReportMixin, Cache):
    """K/V in fixed-size blocks of a pool with per-row block tables, inside ``generate()`` (PagedAttention,
    https://arxiv.org/abs/2309.06180).

    Rows that ``num_return_sequences`` or ``num_beams`` create from one prompt store that prompt once (shared blocks
    with reference counts); a row that writes into a shared, partly filled block copies it first (copy-on-write).
    Beam search reorders block tables instead of copying K/V, and finished rows release their blocks. Lossless:
    outputs equal ``DynamicCache``'s. The model's own sliding-window layers (hybrid models) keep a plain window, as
    ``DynamicCache`` does.

    Left padding: built from a model, the cache reads each row's padding from the attention mask (a forward hook,
    only for forwards passed this cache) and stores no block that holds only a row's left padding; built from a
    config, call ``cache.padding.observe(attention_mask)`` before prefilling a left-padded batch, or padding is
    stored like any token (as ``DynamicCache`` does).

    Attention: with any attention implementation (eager, sdpa, ...) each forward gathers the rows' blocks into
    contiguous K/V. After :func:`hf_kvcache.attention.use_paged_attention` (``model.set_attn_implementation(
    "hf_kvcache_paged")``) attention reads the blocks through the block tables instead, without that copy.

    Args:
        config: the model's ``PretrainedConfig``, or the model itself (recommended: left padding is then not stored).
        block_size: token slots per block, >= 1.
        num_blocks: None grows the pool on demand (in chunks; existing blocks never move); an integer preallocates a
            fixed pool of that many blocks (one block holds ``block_size`` tokens of every full-attention layer).
            Running out raises ``PoolExhaustedError`` (a ``RuntimeError``) that says how many blocks to allow,
            and leaves the cache as it was.
        grow_blocks: smallest growth step of an on-demand pool.

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
    ):
        model = config if isinstance(config, torch.nn.Module) else None
        config = resolve_config(config)
        _check_int("block_size", block_size, 1)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, 1)
        _check_int("grow_blocks", grow_blocks, 1)
        specs = layer_specs(config, type(self).__name__)
        self.block_size, self.num_blocks, self.grow_blocks = block_size, num_blocks, grow_blocks
        self.layer_specs = specs
        self.padding = PaddingTracker()
        self.state = PagedState(block_size, num_blocks, grow_blocks, config, self.padding)
        layers, rank = [], 0
        for spec in specs:
            if spec.layer_type == "full_attention":
                layers.append(PagedLayer(self.state, rank))
                rank += 1
            else:
                layers.append(_SlidingWindowLayer(spec.sliding_window))
        super().__init__(layers=layers)
        if model is not None:
            self.padding.attach(model, self)

    def block_report(self) -> dict:
        """Pool size, blocks used / free / shared, allocated slots and waste: the fraction of allocated slots past
        each row's last token (the unused tail of its last block). Padding slots of a stored block count as filled."""
        return self.state.report()

    def memory_report(self) -> dict:
        return super().memory_report() | {"blocks": self.block_report()}

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` with the broken state if the pool and the block tables disagree."""
        self.state.allocator.check_invariants(self.state.tables.tables)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, num_blocks={self.num_blocks}, "
            f"layers={len(self.layers)})"
        )
