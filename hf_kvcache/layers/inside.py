"""A layer around the cache's own attention layer: one that keeps something beside it (recurrent states: Falcon-H1,
Zamba; a sparse attention's indexer keys: DeepSeek-V3.2), where every K/V operation goes to the attention layer and
the lifecycle and batch operations to both; and :class:`SplitKeys`, which stores a NoPE latent in both of its slots."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .._config import LayerSpec

__all__ = ["AttentionInside", "SplitKeys"]


class AttentionInside(CacheLayerMixin):
    """A layer that keeps something beside the cache's own layer for the attention's K/V (``attention``: quantized,
    paged, windowed): every K/V operation goes to that layer; reset, crop and the batch-axis operations go to both
    (subclasses take their share in :meth:`_beside`), and the bytes are both's."""

    is_compileable = False
    attention: CacheLayerMixin

    # what the model and the cache ask of an attention layer: the inner layer's answer
    keys = property(lambda self: getattr(self.attention, "keys", None))
    values = property(lambda self: getattr(self.attention, "values", None))
    is_initialized = property(lambda self: getattr(self.attention, "is_initialized", False))
    is_sliding = property(lambda self: getattr(self.attention, "is_sliding", False))
    is_croppable = property(lambda self: getattr(self.attention, "is_croppable", False))
    stored_tokens = property(lambda self: self.attention.stored_tokens)

    def _beside(self, operation: str, *args) -> None:
        """Apply ``operation`` (reset, crop, reorder_cache, batch_repeat_interleave, batch_select_indices, offload,
        prefetch) to what the layer keeps beside the attention."""
        raise NotImplementedError

    def _beside_nbytes(self, reserved: bool = False) -> int:
        raise NotImplementedError

    def lazy_initialization(self, *args, **kwargs) -> None:
        self.attention.lazy_initialization(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store a forward's K/V without the read (:func:`hf_kvcache.prefill.write_tokens`)."""
        write = getattr(self.attention, "write", None)
        if write is not None:
            write(key_states, value_states)
        else:
            self.attention.update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_mask_sizes(self, *args, **kwargs):
        return self.attention.get_mask_sizes(*args, **kwargs)

    def get_max_length(self) -> int:
        return self.attention.get_max_length()

    def decode_equivalent_tokens(self, limit: int) -> int:
        """The attention layer's (:mod:`hf_kvcache.scoring`): what is kept beside it is computed from exact keys."""
        return self.attention.decode_equivalent_tokens(limit)

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> int:
        return self.attention.planned_nbytes(tokens, dtype, prompt)

    @property
    def nbytes(self) -> int:
        return self._beside_nbytes() + self.attention.nbytes

    @property
    def reserved_nbytes(self) -> int:
        return self._beside_nbytes(reserved=True) + self.attention.reserved_nbytes

    def reset(self) -> None:
        self._beside("reset")
        self.attention.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self._beside("crop", tokens_to_remove)
        self.attention.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._beside("reorder_cache", beam_idx)
        self.attention.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._beside("batch_repeat_interleave", repeats)
        self.attention.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._beside("batch_select_indices", indices)
        self.attention.batch_select_indices(indices)

    def offload(self) -> None:
        self._beside("offload")
        self.attention.offload()

    def prefetch(self) -> None:
        self._beside("prefetch")
        self.attention.prefetch()


class SplitKeys(AttentionInside):
    """A NoPE latent-attention layer (GLM-5-Next: ``qk_rope_head_dim = 0``, :attr:`LayerSpec.split_keys`): the model
    passes its latent as the keys and a value of no channels. The attention layer stores the latent's first
    ``key_dim`` channels in its key slot and the other ``value_dim`` in its value slot, so every format, kernel and
    pool holds two non-empty halves (the bytes are the latent's), and the latent goes back to the model whole, beside
    an empty value."""

    def __init__(self, attention, spec: LayerSpec, layer_idx: int, owner: str):
        self.attention, self.spec, self.layer_idx, self.owner = attention, spec, layer_idx, owner

    keys = property(lambda self: self._stored()[0])
    values = property(lambda self: self._stored()[1])

    def _stored(self):
        """The attention layer's dense ``keys`` / ``values`` where it keeps them, as the model passed them."""
        return self._whole(getattr(self.attention, "keys", None), getattr(self.attention, "values", None))

    def _halves(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.spec.passed_key_dim
        if key_states.shape[-1] != width or value_states.shape[-1] != 0:
            raise ValueError(
                f"{self.owner} layer {self.layer_idx} was built from a config whose latent attention passes keys of "
                f"{width} channels and values of none; this forward passed keys of {key_states.shape[-1]} and values "
                f"of {value_states.shape[-1]}"
            )
        # contiguous: the formats view a forward's tokens by groups of channels
        return key_states[..., : self.spec.key_dim].contiguous(), key_states[..., self.spec.key_dim :].contiguous()

    @staticmethod
    def _whole(keys, values):
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return keys, values
        return torch.cat([keys, values], dim=-1), values[..., :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._whole(*self.attention.update(*self._halves(key_states, value_states), *args, **kwargs))

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().write(*self._halves(key_states, value_states))

    def _beside(self, operation: str, *args) -> None:
        """Nothing is kept beside the attention layer."""

    def _beside_nbytes(self, reserved: bool = False) -> int:
        return 0
