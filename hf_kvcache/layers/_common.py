"""Pieces all hf_kvcache cache layers share: the lifecycle contract, the crop argument convention, batch-axis
operations and the padding tracker.

Lifecycle contract (every layer, every cache kind):

* A layer takes its batch size, dtype and device from the first forward after construction or ``reset()``.
* A later forward whose batch size, dtype, device, heads or widths differ raises ``ValueError`` (never a wrong
  answer): reuse a cache for another batch only after ``cache.reset()``, or make a new one.
* ``reset()`` returns the layer to its freshly constructed state: its storage is released, and the next forward may
  bring any batch size, dtype and device, as with a new cache.
* Batch-axis operations (``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``) change the batch
  size the layer expects next.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from .._compat import cache_arg, forward_parameters
from .._config import LayerSpec, has_state_layers
from ..attention import MAX_DECODE_QUERY, POSITION_BIAS_REFUSAL, is_hf_kvcache_attention

__all__ = [
    "AttentionMode",
    "BatchOpsMixin",
    "KVLayer",
    "PaddingTracker",
    "as_index",
    "check_same_state",
    "tokens_to_crop",
]


# Where the kernels are the pure-torch reference (not CUDA), reading a layer's storage in place beats dequantizing it
# into a workspace for sdpa only once the history is long: the layers' CPU_HANDLE_TOKENS say from how many stored
# tokens x rows. "always" hands the storage over whatever the length (no workspace: the least memory; the test suite
# runs so), "never" keeps sdpa's path on CPU. Read at every forward, from HF_KVCACHE_CPU_HANDLES at import.
CPU_HANDLES_CHOICES = ("auto", "always", "never")
CPU_HANDLES = os.environ.get("HF_KVCACHE_CPU_HANDLES", "auto")


def tokens_to_crop(tokens_to_remove: int) -> int:
    """``generate()`` crops with ``tokens_to_remove <= 0`` (the number of tokens to drop, negated)."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop(tokens_to_remove={tokens_to_remove}) is not supported: pass a negative number of tokens to remove"
        )
    return -tokens_to_remove


def as_index(indices, device: torch.device | None = None) -> torch.Tensor:
    """Row indices as a 1-D long tensor: a tensor, list or tuple (transformers' own tests pass tuples), or a boolean
    row mask."""
    index = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
    index = index.nonzero().reshape(-1) if index.dtype == torch.bool else index.long().reshape(-1)
    return index.to(device) if device is not None else index


class BatchOpsMixin:
    """``reorder_cache`` (beam search), ``batch_repeat_interleave`` and ``batch_select_indices`` through one
    ``_map_batch(fn, batch)`` that applies a batch-axis function to every stored tensor; ``batch`` is the new size."""

    batch_size: int | None

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor], batch: int) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), len(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = None if self.batch_size is None else self.batch_size * repeats
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), batch)

    def batch_select_indices(self, indices) -> None:
        index = as_index(indices)
        self._map_batch(lambda t: t.index_select(0, index.to(t.device)), len(index))


def check_takes_a_cache(model, config) -> None:
    """Refuse a model whose forward takes no cache argument (it keeps its own state, or none): no cache, and no plan
    of one, can serve it."""
    if not _takes_a_cache(model):
        raise ValueError(
            f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) takes no cache argument "
            "(neither cache nor past_key_values: it keeps its own state or none), so no KV cache can serve it"
        )


def _takes_a_cache(model) -> bool:
    parameters = forward_parameters(model)
    if parameters is None:
        return True  # nothing to read: let the first forward decide
    return cache_arg(model) is not None  # every causal LM of transformers that takes one names it so


def _hybrid_routing_attention(model, config) -> bool:
    """A model with recurrent layers beside its attention (Qwen3-Next, Jamba, Nemotron-H, ...) whose modeling module
    calls transformers' AttentionInterface: transformers leaves ``_supports_attention_backend`` False on most such
    classes (its flag also promises attention backends that run every layer, which recurrent layers do not allow),
    while their attention layers call the registered attention function as any other model's do."""
    module = sys.modules.get(type(model).__module__)
    return has_state_layers(config) and module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def _adds_position_bias(model) -> bool:
    """Whether the model's attention modules hand their attention function an additive score bias
    (``position_bias=``: Inkling's relative-position logits), which a storage handle's kernels do not add. Read from
    the modules' ``forward`` source, as nothing else says it before the first decode step; the attention function
    refuses such a bias beside a handle in any case (:func:`hf_kvcache.attention.hf_kvcache_attention`)."""
    return any(_forward_passes_position_bias(cls) for cls in {type(module) for module in model.modules()})


@functools.cache
def _forward_passes_position_bias(cls: type) -> bool:
    """Read once per class (a harness builds many caches for one model)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # built in, or no source shipped
        return False
    return "attention_interface(" in source and "position_bias=" in source.replace(" ", "")


class AttentionMode:
    """Whether a cache's layers answer a forward with a storage handle (:mod:`hf_kvcache.attention`) instead of
    materialized K/V: when the model's config names the ``hf_kvcache`` attention, the forward brings at most
    :data:`~hf_kvcache.attention.MAX_DECODE_QUERY` new tokens, there is stored history, and the model's attention
    reads what the cache returns (``fusable``; not so for latent attention, which expands the latents first)."""

    def __init__(self, config, fusable: bool = True, model=None):
        self.fusable = fusable
        self.bind(config, model)

    def bind(self, config, model=None) -> None:
        """Serve ``config`` (the model's own: its ``_attn_implementation`` is read at every forward, so a model
        switched with ``set_attn_implementation`` is followed) and, given one, check ``model``."""
        self.config = config
        self.refusal = None
        if model is not None:
            check_takes_a_cache(model, config)
        if (
            model is not None
            and getattr(type(model), "_supports_attention_backend", True) is False
            and not _hybrid_routing_attention(model, config)
        ):
            self.refusal = (
                f"{type(model).__name__} (model_type {self.model_type!r}) does not route attention "
                "through transformers' AttentionInterface (_supports_attention_backend is False), so "
                "attn_implementation='hf_kvcache' cannot serve it; load or set it with 'sdpa' or 'eager', which "
                "every hf_kvcache cache serves"
            )
        elif model is not None and _adds_position_bias(model):
            self.refusal = POSITION_BIAS_REFUSAL.format(self.model_type)
        self.check()

    def __deepcopy__(self, memo: dict) -> AttentionMode:
        # A copied cache serves the same model: it keeps reading that model's config (a deep copy of the config would
        # stop following set_attn_implementation, and hand a storage handle to sdpa once the model is switched back).
        clone = copy.copy(self)
        memo[id(self)] = clone
        return clone

    @property
    def model_type(self) -> str | None:
        return getattr(self.config, "model_type", None)

    def check(self) -> None:
        """Refuse the ``hf_kvcache`` attention on a model that would hand our storage handle to its own attention
        code (checked at construction and every forward: the model may be switched in between)."""
        if self.refusal is not None and is_hf_kvcache_attention(getattr(self.config, "_attn_implementation", None)):
            raise ValueError(self.refusal)

    def handles(self, new_tokens: int, past_tokens: int) -> bool:
        self.check()
        return (
            self.fusable
            and past_tokens > 0
            and new_tokens <= MAX_DECODE_QUERY
            and is_hf_kvcache_attention(getattr(self.config, "_attn_implementation", None))
        )


class KVLayer(BatchOpsMixin, CacheLayerMixin):
    """Base of the hf_kvcache layers: knows its :class:`LayerSpec` and enforces the lifecycle contract above.

    Subclasses allocate in :meth:`_initialize`, release in :meth:`_release` and call :meth:`_begin_update` first in
    ``update``.
    """

    is_croppable = True
    # Tokens x rows of stored history from which, off CUDA, a forward under the hf_kvcache attention gets a storage
    # handle (the reference kernels) instead of materialized K/V (sdpa); None: never off CUDA (see CPU_HANDLES).
    CPU_HANDLE_TOKENS: int | None = 0

    def __init__(self, spec: LayerSpec, layer_idx: int, owner: str, mode: AttentionMode | None = None):
        super().__init__()
        self.mode = mode or AttentionMode(None, fusable=False)
        self.spec = spec
        self.layer_idx = layer_idx
        self.owner = owner  # the cache's class name, for messages
        self.batch_size: int | None = None
        self.cumulative_length = 0  # tokens processed, evicted ones included

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_widths(key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size = key_states.shape[0]
        self.is_initialized = True
        self._initialize(key_states, value_states)

    def _initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate what the first forward needs (storage may also grow lazily)."""

    def _release(self) -> None:
        """Drop all storage."""

    def reset(self) -> None:
        """Back to the freshly constructed state: storage released; any batch, dtype and device may come next."""
        self._release()
        self.is_initialized = False
        self.batch_size = None
        self.cumulative_length = 0

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store a forward's new keys and values without building what its attention would read: the same state as
        :meth:`update`, none of its reads (a dequantized history, a gather of pages). What a prefill computed once
        and handed to several caches needs (:func:`hf_kvcache.prefill.store_prefill`). Layers whose update has no
        read to skip inherit this one."""
        self.update(key_states, value_states)

    def decode_equivalent_tokens(self, limit: int) -> int:
        """How many of the next tokens (at most ``limit``) one forward can take and give the logits and stored state
        of one forward per token (:mod:`hf_kvcache.scoring`). One unless a layer knows better: a forward reads its
        own tokens exactly, so any layer that reads a token back in another form, or evicts, differs past it."""
        return 1

    def _begin_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            return
        check_same_state(self, key_states)
        self._check_widths(key_states, value_states)

    def _check_widths(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        spec = self.spec
        got = (key_states.shape[1], key_states.shape[-1], value_states.shape[1], value_states.shape[-1])
        want = (spec.num_kv_heads, spec.key_dim, spec.num_kv_heads, spec.value_dim)
        if got != want or key_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
            model_type = self.mode.model_type
            named = f" (model_type {model_type!r})" if model_type else ""
            raise ValueError(
                f"{self.owner} layer {self.layer_idx}{named} was built from a config whose layer passes keys "
                f"(B, {want[0]}, T, {want[1]}) and values (B, {want[2]}, T, {want[3]}); this forward passed keys "
                f"{tuple(key_states.shape)} and values {tuple(value_states.shape)}. Build the cache from the model "
                "itself (make_cache(spec, model)), which reads the widths its attention modules project; if it was, "
                "the model's attention passes its keys in a layout no hf_kvcache cache serves: use DynamicCache."
            )

    def _hands_storage(self, new_tokens: int, past_tokens: int) -> bool:
        """Whether this forward gets a storage handle: the hf_kvcache attention, a decode-sized forward and stored
        history (:meth:`AttentionMode.handles`); off CUDA also a history of at least :attr:`CPU_HANDLE_TOKENS`
        tokens x rows (under :data:`CPU_HANDLES` ``"auto"``), where the reference kernels pay off."""
        if not self.mode.handles(new_tokens, past_tokens):
            return False
        if self.device.type == "cuda":
            return True
        choice = CPU_HANDLES
        if choice not in CPU_HANDLES_CHOICES:
            raise ValueError(f"HF_KVCACHE_CPU_HANDLES must be one of {', '.join(CPU_HANDLES_CHOICES)}, got {choice!r}")
        if choice != "auto":
            return choice == "always"
        threshold = self._cpu_handle_tokens()
        return threshold is not None and past_tokens * self.batch_size >= threshold

    def _cpu_handle_tokens(self) -> int | None:
        """:attr:`CPU_HANDLE_TOKENS`, or what a layer decides from its storage format."""
        return self.CPU_HANDLE_TOKENS

    def _set_batch(self, batch: int | None) -> None:
        if self.is_initialized:
            self.batch_size = batch


def check_same_state(layer, key_states: torch.Tensor) -> None:
    """Raise ``ValueError`` if a forward's batch size, dtype or device differs from what ``layer`` holds."""
    b, dtype, device = key_states.shape[0], key_states.dtype, key_states.device
    if b != layer.batch_size or dtype != layer.dtype or device != layer.device:
        raise ValueError(
            f"{layer.owner} layer {layer.layer_idx} holds a batch of {layer.batch_size} rows of {layer.dtype} on "
            f"{layer.device}; this forward passes {b} rows of {dtype} on {device}. Call cache.reset() before "
            "reusing a cache for another batch, dtype or device, or make a new cache."
        )


class PaddingTracker:
    """Leading padding of each batch row, read from the 2-D attention mask of the forwards that use a cache.

    transformers gives a cache layer its keys and values only, never the attention mask. When the cache is built
    from a model, the model's forward pre-hook (:mod:`hf_kvcache._hooks`, one per model) hands this tracker the mask
    of every forward that is passed the cache. A cache built from a config can be told with :meth:`observe`;
    otherwise rows count as unpadded.
    """

    def __init__(self) -> None:
        self.pad: tuple[int, ...] | None = None  # leading zero columns per row of the last mask seen

    def observe(self, attention_mask: torch.Tensor | None) -> None:
        """Record the padding of a 2-D ``(batch, tokens)`` attention mask (1 = real token, 0 = padding)."""
        if attention_mask is None or attention_mask.dim() != 2:
            return
        real = attention_mask != 0
        self.pad = tuple((real.cumsum(-1) == 0).sum(-1).tolist())

    def reset(self) -> None:
        self.pad = None

    def pads(self, batch: int) -> tuple[int, ...]:
        """Leading padding per row; zeros when nothing was observed for a batch of this size."""
        pad = self.pad
        return pad if pad is not None and len(pad) == batch else (0,) * batch

    def real_tokens(self, seen: int, batch: int) -> list[int]:
        """Real tokens per row among the ``seen`` processed."""
        return [max(seen - p, 0) for p in self.pads(batch)]
