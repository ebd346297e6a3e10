"""Attention-sink + sliding-window cache layer (StreamingLLM, https://arxiv.org/abs/2309.17453).

A layer stores, per batch row, its first ``sinks`` real tokens and its last ``window`` tokens: at most
``sinks + window`` slots. A forward attends to ``[sinks ; window ; new tokens]``; eviction happens after the forward,
so the tokens of a multi-token forward (prefill) attend to each other under the model's own causal mask.

Slots and mask columns. transformers builds the mask from ``get_mask_sizes``: returned slot ``j`` is read as absolute
column ``seen - stored + j`` of the 2-D attention mask. Each row's layout is chosen so that this is right:

* a row with at most ``stored`` real tokens keeps exactly the last ``stored`` tokens of its sequence (left padding
  included, and masked as padding, as in ``DynamicCache``);
* a row with more real tokens keeps its first ``sinks`` real tokens, then its last ``stored - sinks`` tokens; every
  slot is a real token and every column it is read at is unmasked.

So rows with different left padding share one slot count; a row only starts evicting once it has more real tokens
than the cache holds. Which tokens are padding comes from the attention mask (see :class:`PaddingTracker`).

Positions. Cached keys keep their RoPE rotation. With re-rotation on, the sink keys handed to attention are rotated
by ``delta = real tokens - stored`` so that they sit right before the window (the stored sinks keep their original
rotation; each forward rotates a fresh copy, so nothing drifts over a long stream).

Storage: the window's slots are a :class:`~hf_kvcache.layers._storage.TokenBuffers` (eviction drops tokens from its
front, a crop truncates its tail), of the keys and values themselves or of the int8 codes and scales of the quantized
cache's :class:`~hf_kvcache.formats.Int8Codec`; a token is encoded once, when it arrives, straight into its
slot. The sink slots, once eviction has begun, are a small dict of tensors of the same parts.
"""

from __future__ import annotations

import torch

from .._config import LayerSpec
from ..formats import DenseSegment, IdentityCodec, KVHandle
from ..formats._base import Parts
from ..rope import RotarySpec, rerotate
from ._common import AttentionMode, KVLayer, PaddingTracker, tokens_to_crop
from ._storage import TokenBuffers, Workspace, _nbytes


def _cat(a: Parts | None, b: Parts) -> Parts:
    return b if a is None else {name: torch.cat([a[name], b[name]], dim=2) for name in b}


def _slice(parts: Parts, start: int, stop: int | None = None) -> Parts:
    return {name: t[:, :, start:stop] for name, t in parts.items()}


def _length(parts: Parts | None) -> int:
    return 0 if parts is None else next(iter(parts.values())).shape[2]


def _gather_rows(parts: Parts, starts: list[int], n: int) -> Parts:
    """Per row ``r``, slots ``starts[r] .. starts[r] + n``."""
    out = {}
    for name, t in parts.items():
        first = torch.tensor(starts, device=t.device).view(-1, 1)
        idx = (first + torch.arange(n, device=t.device)).view(-1, 1, n, *([1] * (t.dim() - 3)))
        out[name] = t.gather(2, idx.expand(t.shape[0], t.shape[1], n, *t.shape[3:]))
    return out


def _parts_nbytes(parts: Parts | None) -> int:
    return 0 if parts is None else sum(_nbytes(t) for t in parts.values())


class SinkWindowLayer(KVLayer):
    """Full-attention layer that keeps ``sinks`` first tokens and a ``window`` of recent ones.

    See the module docstring for the layout. While ``generate()`` records the past (assisted and prompt-lookup
    decoding), eviction waits for ``crop``, so a rejected draft can be undone exactly.
    """

    is_sliding = False
    # Its history is at most sinks + window tokens, which the reference reads at 0.45-0.78x of sdpa on one CPU thread
    # (SmolLM2, a 1,024-token window, 1 to 4 rows): off CUDA it keeps sdpa's path.
    CPU_HANDLE_TOKENS = None

    def __init__(
        self,
        spec: LayerSpec,
        layer_idx: int,
        owner: str,
        window: int,
        sinks: int,
        rotary: RotarySpec | None,
        padding: PaddingTracker,
        codec=None,
        workspace: Workspace | None = None,
        mode: AttentionMode | None = None,
    ):
        super().__init__(spec, layer_idx, owner, mode)
        self.window, self.sinks = window, sinks
        self.capacity = window + sinks
        self.rotary = rotary
        self.padding = padding
        self.codec = codec or IdentityCodec()
        self.workspace = workspace or Workspace()
        self.head: Parts | None = None  # the sink slots once eviction has begun (original rotation)
        self.store = TokenBuffers(self.codec.units, shrink=True)  # the slots after them, oldest first
        self.record_past = False
        self._pad_tensor: tuple[tuple, torch.Tensor] | None = None  # (pads, (B,) tensor on the layer's device)

    # -- CacheLayerMixin ------------------------------------------------------------------------------------------

    def _release(self) -> None:
        self.head = None
        self.store.release()
        self._pad_tensor = None

    def activate_past_recording(self) -> None:
        self.record_past = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._begin_update(key_states, value_states)
        head, body = self._visible()
        if self._hands_storage(key_states.shape[-2], _length(head) + _length(body)):
            keys = values = self._handle(head, body, key_states, value_states)
        else:
            keys, values = self._attended(head, body, key_states, value_states)
        self._extend_body(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.record_past:
            self._evict()
        return keys, values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._begin_update(key_states, value_states)
        self._extend_body(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.record_past:
            self._evict()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        visible = min(self.stored_tokens, self.capacity)
        return visible + query_length, self.cumulative_length - visible

    def get_max_length(self) -> int:
        return -1  # the position can grow without bound; the storage cannot

    def decode_equivalent_tokens(self, limit: int) -> int:
        """How many of the next tokens (at most ``limit``) one forward can take with the logits and stored state of
        one forward per token (:mod:`hf_kvcache.scoring`): until the window would evict after one of them (a
        decoding query never sees what was evicted before it; a chunk's queries would). Quantized slots are read back
        in their stored form by the next token: one token per forward then."""
        if not isinstance(self.codec, IdentityCodec):
            return 1
        return max(1, min(limit, self.capacity - self.stored_tokens + 1))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens, then evict down to ``sinks + window``.

        Undoing tokens after eviction has begun needs the tokens they pushed out of the window: they are kept while
        the past is recorded (``generate()`` turns that on for assisted and prompt-lookup decoding), and a crop that
        would need more raises ``ValueError``.
        """
        n = tokens_to_crop(tokens_to_remove)
        if n:
            stored = self.stored_tokens
            evicted = self.cumulative_length - stored
            needed = min(self.cumulative_length - n, self.capacity)
            if n > _length(self.body) or (evicted and stored - n < needed):
                raise ValueError(
                    f"cannot crop {n} tokens: this layer holds {stored} of {self.cumulative_length} tokens, and "
                    f"undoing {n} would need tokens already evicted from the window. Call "
                    "cache.activate_past_recording() before forwards you may undo (generate() does this for "
                    "assisted decoding), or crop fewer tokens."
                )
            self.store.truncate(n)
            self.cumulative_length -= n
        self._evict()

    def offload(self) -> None:
        self._map_parts(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map_parts(lambda t: t.to(self.device, non_blocking=True))

    # -- reporting ------------------------------------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        return _length(self.head) + _length(self.body)

    @property
    def quantized_tokens(self) -> int:
        return 0 if isinstance(self.codec, IdentityCodec) else self.stored_tokens

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> float:
        """Bytes one row stores after ``tokens`` tokens of ``dtype`` K/V: at most ``sinks + window`` of them
        (:mod:`hf_kvcache.plan`)."""
        spec = self.spec
        per_token = self.codec.bytes_per_token(spec.num_kv_heads, spec.key_dim, spec.value_dim, dtype)
        return min(tokens, self.sinks + self.window) * per_token

    @property
    def nbytes(self) -> int:
        """Bytes of the stored slots (codes and scales when quantized)."""
        return _parts_nbytes(self.head) + _parts_nbytes(self.body)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of the allocations behind the stored slots: the sinks' and the window's, with its headroom."""
        return _parts_nbytes(self.head) + self.store.reserved_nbytes

    # -- internals ------------------------------------------------------------------------------------------------

    @property
    def body(self) -> Parts | None:
        """The window's slots, oldest first: views of the storage (None before the first token)."""
        return self.store.views() if self.store.tensors else None

    def _extend_body(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens after the window, encoded straight into their slots (one launch on CUDA); eviction drops
        slots from the front, so the window is never concatenated anew (the buffer compacts once its headroom is
        used up, amortized)."""
        n = k.shape[2]
        self.store.append_written(n, lambda: self.codec.like(k, v), lambda out: self.codec.encode_into(k, v, out))

    def _real_tokens(self) -> list[int]:
        return self.padding.real_tokens(self.cumulative_length, self.batch_size)

    def _pads(self, device: torch.device) -> torch.Tensor:
        """``(B,)`` leading padding per row as a tensor, rebuilt only when the padding changes."""
        pads = self.padding.pads(self.batch_size)
        if self._pad_tensor is None or self._pad_tensor[0] != pads:
            self._pad_tensor = (pads, torch.tensor(pads, device=device))
        return self._pad_tensor[1]

    def _visible(self) -> tuple[Parts | None, Parts | None]:
        """``(sink slots, window slots)`` the next forward attends to, without changing the stored state."""
        if self.stored_tokens <= self.capacity:
            return self.head, self.body
        return self._select(self.capacity)

    def _select(self, keep: int) -> tuple[Parts, Parts]:
        """Per-row layout of ``keep`` slots (see the module docstring): sink slots, then the last window slots."""
        stored = self.stored_tokens
        body = _slice(self.body, _length(self.body) - (keep - self.sinks))
        if self.sinks == 0:
            return None, body
        # Where a row's sinks start among the stored slots: 0 once it has more real tokens than slots (its sinks are
        # already in front), else its first kept slot of a contiguous tail. Plain ints: the padding is host-side.
        starts = [min(max(stored - real, 0), stored - keep) for real in self._real_tokens()]
        if self.head is not None and not any(starts):
            return self.head, body
        everything = _cat(self.head, self.body)
        head = _gather_rows(everything, starts, self.sinks)
        if self.head is not None:
            keep_old = torch.tensor([s == 0 for s in starts], device=self.device)
            head = {
                name: torch.where(keep_old.view(-1, *([1] * (t.dim() - 1))), self.head[name], t)
                for name, t in head.items()
            }
        return head, body

    def _evict(self) -> None:
        if self.stored_tokens > self.capacity:
            self.head, body = self._select(self.capacity)
            self.store.drop_front(self.store.length - _length(body))  # the window keeps its last slots

    def _rotate_sinks(self, keys: torch.Tensor, stored: int) -> None:
        """Re-rotate decoded sink keys in place to sit right before the window (see the module docstring)."""
        if self.rotary is not None and self.cumulative_length > stored:
            # Rows with no eviction yet get delta 0, an exact identity rotation: no data-dependent branch, so a
            # compiled decode step has no graph break here.
            delta = (self.cumulative_length - stored - self._pads(keys.device)).clamp(min=0)
            keys.copy_(rerotate(keys, delta, self.rotary))

    def _handle(self, head, body, k_new, v_new) -> KVHandle:
        """``[sinks ; window ; new]`` for the kernels: the window as views of the storage; the sinks (a few tokens)
        decoded and re-rotated into a small copy when they need moving."""
        nh, nb = _length(head), _length(body)
        segments = []
        if nh and self.rotary is not None:
            keys = k_new.new_empty((*k_new.shape[:2], nh, k_new.shape[-1]))  # (B, H, sinks, Dk)
            values = v_new.new_empty((*v_new.shape[:2], nh, v_new.shape[-1]))
            self.codec.decode(head, keys, values)
            self._rotate_sinks(keys, nh + nb)
            segments.append(DenseSegment(keys, values))
        elif nh:
            segments.append(self.codec.segment(head))
        if nb:
            segments.append(self.codec.segment(body))
        segments.append(DenseSegment(k_new, v_new))
        return KVHandle(tuple(segments), self.mode.model_type)

    def _attended(self, head, body, k_new, v_new) -> tuple[torch.Tensor, torch.Tensor]:
        """``[sinks (re-rotated) ; window ; new]`` in full precision."""
        nh, nb, n = _length(head), _length(body), k_new.shape[-2]
        if nh + nb == 0:
            return k_new, v_new
        if n == 1:  # decode: the shared workspace, sized sinks + window + 1 for good
            keys, values = self.workspace.take(k_new, v_new, nh + nb + n)
        else:  # a prefill may be far longer than the window: a one-off buffer, so the workspace stays flat
            keys = k_new.new_empty((*k_new.shape[:2], nh + nb + n, k_new.shape[-1]))  # (B, H, T, Dk)
            values = v_new.new_empty((*v_new.shape[:2], nh + nb + n, v_new.shape[-1]))  # (B, H, T, Dv)
        if nh:
            self.codec.decode(head, keys[:, :, :nh], values[:, :, :nh])
            self._rotate_sinks(keys[:, :, :nh], nh + nb)
        if nb:
            self.codec.decode(body, keys[:, :, nh : nh + nb], values[:, :, nh : nh + nb])
        keys[:, :, nh + nb :].copy_(k_new)
        values[:, :, nh + nb :].copy_(v_new)
        return keys, values

    def _map_parts(self, fn) -> None:
        self.head = None if self.head is None else {name: fn(t) for name, t in self.head.items()}
        self.store.map_batch(fn)  # the live slots only, into a fresh tensor (no headroom until the next token)

    def _map_batch(self, fn, batch: int | None) -> None:
        self._map_parts(fn)
        self._set_batch(batch)
