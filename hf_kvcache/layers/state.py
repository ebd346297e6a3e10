"""The layers of hybrid models that keep no per-token keys and values, in every hf_kvcache cache: Mamba / gated
DeltaNet / convolution layers (fixed-size convolution and recurrent states, transformers' ``LinearAttentionLayer``)
and layers with nothing to cache (MoE- or MLP-only blocks, ``DummyLayer``). The cache's attention layers are its own
(quantized, paged, windowed); these are kept exactly as ``DynamicCache`` keeps them, so a hybrid model's recurrent
layers compute what they compute under ``DynamicCache``. They add our reporting (``nbytes``, ``stored_tokens``) and
the lifecycle contract of :mod:`hf_kvcache.layers._common`: a forward of another batch size, dtype or device than
the states hold raises ``ValueError`` instead of broadcasting or failing inside torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from .._config import LayerSpec
from ._common import as_index
from ._storage import _nbytes
from .indexed import IndexedAttention
from .inside import AttentionInside, SplitKeys

__all__ = ["AttentionWithStates", "EmptyLayer", "StateLayer", "cache_layer"]


class StateLayer(LinearAttentionLayer):
    """A ``linear_attention`` or ``conv`` layer: transformers' own layer, with our reporting and lifecycle checks."""

    def __init__(self, spec: LayerSpec, layer_idx: int, owner: str):
        super().__init__(number_of_states=max(spec.states, 1))
        self.spec, self.layer_idx, self.owner = spec, layer_idx, owner

    def _states(self) -> list[torch.Tensor]:
        held = [*self.conv_states.values(), *self.recurrent_states.values()]
        return [t for t in held if isinstance(t, torch.Tensor)]

    def _check(self, states: torch.Tensor, which: str) -> None:
        held = self._states()
        if not held:
            return
        have = held[0]
        if states.shape[0] != have.shape[0] or states.dtype != have.dtype or states.device != have.device:
            raise ValueError(
                f"{self.owner} layer {self.layer_idx} ({self.spec.layer_type}) holds {which} states of batch "
                f"{have.shape[0]}, {have.dtype} on {have.device}; this forward passed batch {states.shape[0]}, "
                f"{states.dtype} on {states.device}. Call cache.reset() (or build a new cache) before another batch"
            )

    def decode_equivalent_tokens(self, limit: int) -> int:
        """Any number (:mod:`hf_kvcache.scoring`): the states are exact, and a longer forward runs the model's chunked
        form of the same recurrence (equal to rounding), as with ``DynamicCache``."""
        return limit

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, *args, **kwargs) -> torch.Tensor:
        self._check(conv_states, "convolution")
        return super().update_conv_state(conv_states, state_idx, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self._check(recurrent_states, "recurrent")
        return super().update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def reset(self) -> None:
        """Back to the freshly constructed state (transformers' ``reset`` zeroes the states in place and keeps their
        batch size; the lifecycle contract lets the next forward bring any)."""
        LinearAttentionCacheLayerMixin.__init__(self, number_of_states=max(self.spec.states, 1))

    def _map_states(self, fn) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                if isinstance(t, torch.Tensor):
                    states[i] = fn(t)

    # transformers' linear-attention layers have reorder_cache only; the other batch-axis operations of every layer
    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_states(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        index = as_index(indices)
        self._map_states(lambda t: t.index_select(0, index.to(t.device)))

    def get_seq_length(self) -> int:
        return 0  # no token axis: the states summarize every token seen

    @property
    def stored_tokens(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self._states())

    state_nbytes = nbytes

    @property
    def reserved_nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._states())

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> int:
        """Per-token K/V bytes (:mod:`hf_kvcache.plan`): none. Its states are a fixed size per row, the same in
        every cache and in ``DynamicCache``."""
        return 0


class AttentionWithStates(AttentionInside, StateLayer):
    """A layer with recurrent states *and* attention (transformers' ``hybrid`` layer type: Falcon-H1, Zamba): the
    states as :class:`StateLayer` keeps them, beside the cache's own layer for the attention's K/V."""

    def __init__(self, attention, spec: LayerSpec, layer_idx: int, owner: str):
        StateLayer.__init__(self, spec, layer_idx, owner)
        self.attention = attention

    def lazy_initialization(self, *args, **kwargs) -> None:
        # positional (key_states, value_states): the attention's; keywords only: a state's (update_conv_state, ...)
        if args:
            self.attention.lazy_initialization(*args, **kwargs)
        else:
            StateLayer.lazy_initialization(self, **kwargs)

    def _beside(self, operation: str, *args) -> None:
        getattr(StateLayer, operation)(self, *args)

    def _beside_nbytes(self, reserved: bool = False) -> int:
        return (StateLayer.reserved_nbytes if reserved else StateLayer.nbytes).fget(self)

    @property
    def state_nbytes(self) -> int:
        return StateLayer.nbytes.fget(self)


class EmptyLayer(DummyLayer):
    """A layer with nothing to cache (MoE- or MLP-only blocks): transformers' ``DummyLayer``, with our reporting."""

    def __init__(self, spec: LayerSpec, layer_idx: int, owner: str):
        super().__init__()
        self.spec, self.layer_idx, self.owner = spec, layer_idx, owner

    def get_seq_length(self) -> int:
        return 0

    stored_tokens = nbytes = reserved_nbytes = 0

    def decode_equivalent_tokens(self, limit: int) -> int:
        return limit  # nothing stored, nothing read back

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> int:
        return 0


def cache_layer(spec: LayerSpec, layer_idx: int, owner: str, attention: Callable[[], object]):
    """The layer a cache keeps for ``spec``: for a :data:`~hf_kvcache._config.STATE_LAYER_TYPES` layer, its states
    (:class:`StateLayer`) or nothing (:class:`EmptyLayer`); for an attention layer, the cache's own (``attention()``,
    called only then), beside its recurrent states where the layer has both (:class:`AttentionWithStates`) or beside
    its indexer keys in a sparse-attention layer (:class:`~hf_kvcache.layers.indexed.IndexedAttention`); a NoPE
    latent's halves in its key and value slots (:class:`~hf_kvcache.layers.inside.SplitKeys`)."""
    if not spec.holds_kv:
        return EmptyLayer(spec, layer_idx, owner) if spec.layer_type == "dummy" else StateLayer(spec, layer_idx, owner)
    layer = attention()
    if spec.split_keys:
        layer = SplitKeys(layer, spec, layer_idx, owner)
    if spec.indexer_dim:  # sparse attention's indexer keys beside the K/V
        return IndexedAttention(layer, spec, layer_idx, owner)
    return AttentionWithStates(layer, spec, layer_idx, owner) if spec.states else layer
