"""Quantized cache layers: quantized history + full-precision residual of the most recent tokens.

A layer's sequence is ``[quantized tokens ; residual tokens]``. New tokens enter the residual; whenever it holds more
than ``residual_length`` tokens, its oldest tokens are encoded, ``unit`` at a time (one token for int8 and for KIVI
with ``key_axis="token"``, one group of ``group_size`` tokens for KIVI's per-channel keys). So the most recent
``residual_length`` tokens are always exact (int8-rounded with ``residual_bits=8``: the residual then holds int8
codes), the residual never holds more than ``residual_length + unit - 1`` tokens, and every token is encoded into the
history exactly once.

A forward attends to ``[decoded history ; residual ; new tokens]``, with the new tokens exact: the tokens a forward
produces are never read back quantized by that same forward (so prefill logits equal ``DynamicCache``'s). An int8
residual is the exception after the prompt: a later forward reads its own tokens int8-rounded, as the residual holds
them and every later forward reads them. Under the
``hf_kvcache`` attention a decode forward gets a :class:`~hf_kvcache.kernels.KVHandle` of those three parts (views of
the codes, scales and residual, taken before the new tokens are stored) and the kernels dequantize in registers;
otherwise the history is decoded into the shared workspace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .._config import LayerSpec
from ..formats import DenseSegment, IdentityCodec, KVHandle, PreRopeSegment
from ..formats._base import KeyTurn
from ..formats.scaled import ScaledSegment, scale_keys, smoothing_scales, unscale_keys
from ..rope import RotarySpec, rotate_positions
from ._common import AttentionMode, KVLayer, PaddingTracker, tokens_to_crop
from ._sinks import RowSinks, fill_front, front_mask
from ._storage import TokenBuffers, Workspace


def encoded_split(tokens: int, residual_length: int, unit: int) -> tuple[int, int]:
    """(encoded, residual) tokens of a full-attention layer that took ``tokens`` in any number of forwards
    (:meth:`QuantizedLayer._append`: the residual keeps at least ``residual_length`` and encodes ``unit`` at a time)."""
    encoded = max(0, (tokens - residual_length) // unit * unit)
    return encoded, tokens - encoded


def sliding_forward(q: int, r: int, n: int, residual_length: int, unit: int, window: int) -> tuple[int, int, int]:
    """(encoded, residual, newly encoded) tokens of a sliding layer holding ``q`` encoded and ``r`` residual tokens
    after a forward of ``n``: :meth:`QuantizedLayer._append`, then :meth:`QuantizedSlidingWindowLayer._evict` down to
    ``window - 1`` tokens, encoded ones only in whole units."""
    encoded = max(r + n - residual_length, 0) // unit * unit
    q, r = q + encoded, r + n - encoded
    excess = q + r - (window - 1)
    if excess > 0:
        if excess >= q:
            q, r = 0, r - (excess - q)
        else:
            q -= excess // unit * unit
    return q, r, encoded


def sliding_encoded_split(tokens: int, prompt: int, residual_length: int, unit: int, window: int) -> tuple[int, int]:
    """(encoded, residual) tokens a sliding layer stores after a ``prompt``-token forward and one token per forward
    up to ``tokens`` (:func:`sliding_forward`). The state is periodic once the window is full, so whole periods are
    skipped."""
    first = min(prompt, tokens)
    q = r = 0
    seen: dict[tuple[int, int], int] = {}
    step, n = 0, first
    while True:
        q, r, _ = sliding_forward(q, r, n, residual_length, unit, window)
        if first + step >= tokens:
            return q, r
        if (q, r) in seen:
            period = step - seen[(q, r)]
            step += (tokens - first - step) // period * period
            seen.clear()
            if first + step >= tokens:
                return q, r
        else:
            seen[(q, r)] = step
        step, n = step + 1, 1


class QuantizedLayer(KVLayer):
    """Full-attention layer with quantized storage. See the module docstring for the layout."""

    is_sliding = False
    # SmolLM2 on one CPU thread, a layer's decode step, reference vs dequantize + sdpa: int8 / int4 0.75-0.89x at
    # 4k x 1, 0.95x at 8k x 1, 1.04-1.12x at 4k x 2, 1.13-1.21x at 4k x 4 and 16k x 1, 1.25-1.41x at 8k x 4.
    CPU_HANDLE_TOKENS = 8192

    def __init__(
        self,
        spec: LayerSpec,
        layer_idx: int,
        owner: str,
        codec,
        residual_length: int,
        workspace: Workspace,
        mode: AttentionMode | None = None,
        sinks: int = 0,
        padding: PaddingTracker | None = None,
        key_rope: RotarySpec | None = None,
        residual_codec=None,
        smooth: float = 0.0,
    ):
        super().__init__(spec, layer_idx, owner, mode)
        self.codec = codec
        # The residual's format: the tokens as they came (IdentityCodec, the default: exact) or int8, encoded as they
        # arrive and decoded when they leave for the codes (a forward still reads its own new tokens exact).
        self.residual_codec = residual_codec or IdentityCodec()
        # pre_rope=True (KVQuant): keys are turned back to before RoPE for quantizing (RoPE mixes each outlier
        # channel with its pair at a different angle every token, which per-channel groups cannot follow) and turned
        # forward again when read. The angle is the token's index in the layer, the same both ways, so a row's left
        # padding only shifts all of its keys by one rotation.
        self.key_rope = key_rope
        self.dropped = 0  # tokens evicted from the front (sliding layers): the stored tokens' positions start here
        self.residual_length = residual_length
        self.workspace = workspace
        self.sinks = sinks  # first real tokens of every row kept in full precision (attention sinks)
        self.padding = padding
        self.store: TokenBuffers | None = None  # codes of every position from `dropped` on
        self.residual: TokenBuffers | None = None  # the most recent tokens, exact
        self.sink: RowSinks | None = None  # each row's first `sinks` real tokens, exact (beside their codes)
        # smooth > 0: the codes hold keys times key_scale ((B, H, Dk) float32, formats.scaled), measured per row on
        # the first real tokens this layer encodes of it and kept until the storage is released; read back divided.
        # Per row, not pooled over the batch: a row's codes, so its answers, are the same in any batch.
        self.smooth = smooth
        self.key_scale: torch.Tensor | None = None
        self.query_scale: torch.Tensor | None = None  # 1 / key_scale in the K/V dtype: what a query is multiplied by
        self._pads: tuple[int, ...] = ()  # each row's left padding, read from the prefill's mask (the sinks' own)
        self._unscaled: tuple[int, ...] = ()  # rows no encoded chunk has yet held an ordinary token of: scales of 1

    # -- CacheLayerMixin ------------------------------------------------------------------------------------------

    def _initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.store = TokenBuffers(self.codec.units)
        self.residual = TokenBuffers(self.residual_codec.units)
        # row r's first real token sits at its left padding p_r (zeros where none was observed)
        b = self.batch_size
        self._pads = self.padding.pads(b) if self.padding is not None else (0,) * b
        if self.sinks:
            self.sink = RowSinks(self.sinks, self._pads, key_states, value_states)
        self.dropped = 0
        self.key_scale = self.query_scale = None
        self._unscaled = tuple(range(b)) if self.smooth else ()
        if self.key_rope is not None:  # on the layer's device once, not copied there by every read
            self.key_rope = dataclasses.replace(self.key_rope, inv_freq=self.key_rope.inv_freq.to(self.device))

    def _release(self) -> None:
        self.store = self.residual = self.sink = self.key_scale = self.query_scale = None
        self._pads = self._unscaled = ()
        self.dropped = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._begin_update(key_states, value_states)
        visible = self._visible_past()
        n = key_states.shape[-2]
        as_stored = self._reads_as_stored
        handles = self._hands_storage(n, visible)
        joins = (self._exact_residual or as_stored) and self._joins_residual(n)
        if joins and (handles or as_stored):
            # The new tokens only join the residual: stored first and read with it. For the kernels one segment (one
            # launch) fewer; an int8 residual's tokens are encoded once, not once to be read and again to be stored.
            self._take_sinks(key_states, value_states)
            self._residual_append(key_states, value_states)
            if handles:
                keys = values = self._handle(key_states, value_states, visible, joined=True)
            else:
                keys, values = self._attended(key_states, value_states, visible, joined=True)
        else:
            read = self._as_stored(key_states, value_states) if as_stored else None
            k_read, v_read = read or (key_states, value_states)
            if handles:
                keys = values = self._handle(k_read, v_read, visible)
            else:
                keys, values = self._attended(k_read, v_read, visible)
            self._append(key_states, value_states, read)
        self.cumulative_length += key_states.shape[-2]
        self._evict()
        return keys, values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._begin_update(key_states, value_states)
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self._evict()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def decode_equivalent_tokens(self, limit: int) -> int:
        """How many of the next tokens (at most ``limit``) one forward can take with the logits and stored state of
        one forward per token (:mod:`hf_kvcache.scoring`). A forward reads its own tokens and an exact residual
        exactly, as decoding does; they differ once decoding would have encoded a unit after one of the chunk's
        tokens, which :meth:`_append` does when the residual passes ``residual_length + unit - 1`` tokens. An int8
        residual: one token per forward. A longer forward would read what one-token forwards read in exact arithmetic
        (:attr:`_reads_as_stored`), but it computes its keys and values in another float order, and int8 codes every
        token's numbers at once: wherever one sits on a rounding boundary it lands a step away (SmolLM2 through int2
        with it: perplexity 46.479 in merged forwards against 46.445 one token per forward, where a full-precision
        residual's agree to rounding)."""
        if not self._exact_residual:
            return 1
        held = self.residual.length if self.is_initialized else 0
        return max(1, min(limit, self.residual_length + self.codec.unit - held))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (``tokens_to_remove <= 0``, as ``generate()`` calls it).

        Tokens in the residual are removed exactly. If the crop reaches into quantized key groups (only when it
        removes more than the residual holds, i.e. more than ``residual_length`` tokens), the surviving tokens of a
        partly removed group go back to the residual as their decoded values and are encoded again with their next
        group: their error is then at most one quantization step instead of half a step.
        """
        n = tokens_to_crop(tokens_to_remove)
        if n and self.is_initialized:
            self._remove_tail(n)
            self.cumulative_length -= n
        self._evict()

    def offload(self) -> None:
        if self.is_initialized:
            for buffers in self._parts():
                buffers.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized:
            for buffers in self._parts():
                buffers.to(self.device, non_blocking=True)

    def _parts(self) -> tuple:
        return (self.store, self.residual) + ((self.sink,) if self.sink is not None else ())

    # -- reporting -----------------------------------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        """Positions held (each row's exact sinks are copies of some of them)."""
        return (self.store.length + self.residual.length) if self.is_initialized else 0

    @property
    def quantized_tokens(self) -> int:
        return self.store.length if self.is_initialized else 0

    @property
    def nbytes(self) -> int:
        """Bytes of live storage: codes, scales, zero points, the residual, the rows' exact sinks and the smoothed
        keys' scales."""
        if not self.is_initialized:
            return 0
        return sum(part.nbytes for part in self._parts()) + self._key_scale_nbytes

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated, including growth headroom (the sinks have none)."""
        if not self.is_initialized:
            return 0
        sinks = self.sink.nbytes if self.sink is not None else 0
        return self.store.reserved_nbytes + self.residual.reserved_nbytes + sinks + self._key_scale_nbytes

    @property
    def _key_scale_nbytes(self) -> int:
        return self.key_scale.nbytes + self.query_scale.nbytes if self.key_scale is not None else 0

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> float:
        """Bytes one row stores after ``tokens`` tokens of ``dtype`` K/V, ``prompt`` of them in the first forward
        (default: all) and the rest one per forward (:mod:`hf_kvcache.plan`): codes, the residual, ``sinks`` exact
        tokens from the first token on, and smoothed keys' float32 scales and their inverses in ``dtype`` from the
        first encoded token on (padding changes none of it)."""
        prompt = tokens if prompt is None else prompt
        encoded, residual = self._planned_split(tokens, prompt)
        spec = self.spec
        coded = self.codec.bytes_per_token(spec.num_kv_heads, spec.key_dim, spec.value_dim, dtype)
        held = self.residual_codec.bytes_per_token(spec.num_kv_heads, spec.key_dim, spec.value_dim, dtype)
        sinks = self.sinks if tokens else 0
        scaled = self.smooth and self._planned_encodes(tokens, prompt)
        scales = spec.num_kv_heads * spec.key_dim * (4 + dtype.itemsize) if scaled else 0
        return encoded * coded + residual * held + sinks * spec.bytes_per_token_factor * dtype.itemsize + scales

    def _planned_split(self, tokens: int, prompt: int) -> tuple[int, int]:
        return encoded_split(tokens, self.residual_length, self.codec.unit)

    def _planned_encodes(self, tokens: int, prompt: int) -> bool:
        """Whether the layer encodes a token on :meth:`planned_nbytes`' path (it keeps every token it encodes)."""
        return self._planned_split(tokens, prompt)[0] > 0

    # -- internals -----------------------------------------------------------------------------------------------

    def _visible_past(self) -> int:
        """How many stored tokens the next forward attends to (all of them on a full-attention layer)."""
        return self.stored_tokens

    def _attended(
        self, k_new: torch.Tensor, v_new: torch.Tensor, visible: int, joined: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[last `visible` stored tokens ; new tokens]``, built in the shared workspace. ``joined``: the new tokens
        were just stored at the residual's end, and are read from there (as it holds them)."""
        joined_n = k_new.shape[-2] if joined else 0
        nq, nr, n = self.store.length, self.residual.length, k_new.shape[-2] - joined_n
        if nq + nr == 0:
            return k_new, v_new
        # Decode the whole stored sequence (at most unit - 1 tokens more than needed on a sliding layer).
        keys, values = self.workspace.take(k_new, v_new, nq + nr + n)
        if nq:
            self.codec.decode(self.store.views(), keys[:, :, :nq], values[:, :, :nq], self._key_turn())
            if self.key_scale is not None:
                unscale_keys(keys[:, :, :nq], self.key_scale)
        if nr:
            self.residual_codec.decode(self.residual.views(), keys[:, :, nq : nq + nr], values[:, :, nq : nq + nr])
        if n:
            keys[:, :, nq + nr :].copy_(k_new)
            values[:, :, nq + nr :].copy_(v_new)
        if self.sink is not None:  # each row's exact sinks over their codes' copies
            self.sink.patch(keys, values, self.dropped, self.cumulative_length + joined_n)
        skip = nq + nr - joined_n - visible
        return keys[:, :, skip:], values[:, :, skip:]

    def _joins_residual(self, n: int) -> bool:
        """Whether :meth:`_append` would put all ``n`` new tokens in the residual: it does not overflow by a whole
        unit (it encodes ``unit`` tokens at a time)."""
        overflow = self.residual.length + n - self.residual_length
        return overflow < self.codec.unit

    def _handle(self, k_new: torch.Tensor, v_new: torch.Tensor, visible: int, joined: bool = False) -> KVHandle:
        """``[last `visible` stored tokens ; new tokens]`` as views for the kernels. Taken before the new tokens are
        stored (a later append writes past these views or into fresh tensors, never over them), or, ``joined``, right
        after they joined the residual: then the residual's segment ends with them. Each row's exact sinks: the first
        segment, the codes read from after them, where no row is padded; else one more segment, outside the mask's
        columns, with the codes' copies of them masked out per row."""
        n = k_new.shape[-2] if joined else 0
        nq, nr = self.store.length, self.residual.length - n
        held = self.cumulative_length + n  # tokens stored, the joined ones included
        skip = nq + nr - visible  # tokens out of a sliding layer's window (there are no sinks there)
        segments, columns, extra, extra_at = [], None, (), ()
        sinks = self.sink
        if sinks is not None and sinks.aligned(held):  # the sinks are positions 0 .. S - 1 of every row
            skip = self.sinks
            segments.append(DenseSegment(sinks.k, sinks.v))
        elif sinks is not None and held > min(sinks.pads):  # a sink held: read exactly, the codes' copies masked out
            segments.append(DenseSegment(sinks.k, sinks.v))
            extra = (None if sinks.complete(held) else sinks.filled(held),)
            extra_at = (sinks.positions(self.dropped + skip),)  # the mask's columns of their codes' copies
            total = nq + self.residual.length - skip + (0 if joined else k_new.shape[-2])  # the mask's columns
            columns = sinks.columns(self.dropped + skip, total, held)
        if skip < nq:
            segment = self.codec.segment(self.store.views(), skip)
            if self.key_rope is not None:
                segment = PreRopeSegment(segment, self.key_rope, self._store_position() + skip)
            if self.key_scale is not None:  # outermost: the query is divided before any launch reads the codes
                segment = ScaledSegment(segment, self.key_scale, self.query_scale)
            segments.append(segment)
        if self.residual.length > max(skip - nq, 0):  # with the new tokens at its end when they joined it
            segments.append(self.residual_codec.segment(self.residual.views(), max(skip - nq, 0)))
        if not joined:
            segments.append(DenseSegment(k_new, v_new))
        return KVHandle(tuple(segments), self.mode.model_type, columns, extra, extra_at)

    def _take_sinks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Each row's sinks among a forward's tokens (positions from :attr:`cumulative_length`), kept exact."""
        if self.sink is not None:
            self.sink.fill(k, v, self.dropped + self.cumulative_length)

    def _append(self, k: torch.Tensor, v: torch.Tensor, read: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Add new tokens to the residual (each row's sinks among them also to the exact sinks); encode the oldest
        residual tokens, ``unit`` at a time, while it exceeds its length. ``read``: the new tokens as this forward
        read them (:meth:`_as_stored`): those encoded without waiting in the residual are encoded from them, the
        values they would have left the residual with."""
        self._take_sinks(k, v)
        unit = self.codec.unit
        overflow = self.residual.length + k.shape[-2] - self.residual_length
        n_encode = max(overflow, 0) // unit * unit
        if n_encode:
            from_res = min(n_encode, self.residual.length)
            from_new = n_encode - from_res
            source_k, source_v = read or (k, v)
            ke, ve = source_k[:, :, :from_new], source_v[:, :, :from_new]
            if from_res:  # the residual's oldest tokens (read in place when no new token joins them)
                kr, vr = self._residual_front(from_res)
                ke, ve = (torch.cat([kr, ke], dim=2), torch.cat([vr, ve], dim=2)) if from_new else (kr, vr)
            first = self._store_position() + self.store.length  # the chunk's first token follows the stored codes
            if self.key_rope is not None:
                ke = rotate_positions(ke, first, self.key_rope, inverse=True)
            if self.sink is not None:  # padding and sinks never set a group's range (they are read exactly)
                ke, ve = self.sink.exclude(ke, first), self.sink.exclude(ve, first)
            elif self.codec.unit > 1:  # key groups span tokens: nor does padding without sinks (it is never read)
                ends = [p - first for p in self._pads]
                ke, ve = fill_front(ke, ends), fill_front(ve, ends)
            if self.smooth:
                ke = self._smoothed(ke, first, lambda: self._staying(from_res, k[:, :, from_new:]))
            encode_into = getattr(self.codec, "encode_into", None)
            if encode_into is not None:  # int8, KIVI: encoded straight into the storage, one launch on CUDA
                self.store.append_written(
                    n_encode, lambda: self.codec.like(ke, ve), lambda out: encode_into(ke, ve, out)
                )
            else:
                self.store.append(self.codec.encode(ke, ve))
            self.residual.drop_front(from_res)
            k, v = k[:, :, from_new:], v[:, :, from_new:]
        if k.shape[-2]:
            self._residual_append(k, v)

    def _smoothed(self, ke: torch.Tensor, first: int, staying: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A chunk of keys (positions ``first ..``, before :meth:`_append` encodes them) times their rows' scales. A
        row's scales are set, for good, by the first chunk holding one of its ordinary tokens (past its padding and
        sinks), from that chunk's tokens and those staying in the residual (``staying()``, the keys that follow the
        chunk), without its padding: at least ``residual_length + 1`` of the row's own tokens, where the chunk alone
        can be a single key group (fewer tokens, noisier scales). A short row left-padded beside long ones waits for
        its own tokens (its codes until then are padding, never read) instead of taking scales from nothing."""
        if self.key_scale is None:
            b, h, _, d = ke.shape
            self.key_scale = torch.ones((b, h, d), dtype=torch.float32, device=ke.device)
        ready = [r for r in self._unscaled if first + ke.shape[2] > self._pads[r] + self.sinks]
        if ready:
            rest = staying()
            if self.key_rope is not None:
                rest = rotate_positions(rest, first + ke.shape[2], self.key_rope, inverse=True)
            stats = torch.cat([ke, rest.to(ke.dtype)], dim=2)
            if any(self._pads[r] > first for r in ready):  # padding left out of the statistics
                padding = front_mask([p - first for p in self._pads], stats.shape[2], ke.device)
                stats = stats.masked_fill(padding[:, None, :, None], float("nan"))
            if len(ready) < ke.shape[0]:
                rows = torch.tensor(ready, device=ke.device)
                self.key_scale[rows] = smoothing_scales(stats[rows], self.smooth, self.key_rope)
            else:
                self.key_scale = smoothing_scales(stats, self.smooth, self.key_rope)
            self.query_scale = self.key_scale.reciprocal().to(self.dtype)
            self._unscaled = tuple(r for r in self._unscaled if r not in ready)
        return scale_keys(ke, self.key_scale)

    def _staying(self, from_res: int, new_k: torch.Tensor) -> torch.Tensor:
        """The keys an encode leaves in the residual, as the model handed them: the residual's past its oldest
        ``from_res`` and the forward's ``new_k`` that follow."""
        if self.residual.length <= from_res:
            return new_k
        held = self._residual_front(self.residual.length)[0][:, :, from_res:]
        return torch.cat([held, new_k.to(held.dtype)], dim=2)

    @property
    def reads_padding(self) -> bool:
        """Whether the layer needs its rows' left padding: its sinks are each row's first real tokens, smoothed keys
        measure a row's scales on its real tokens, and padding never sets the range of a key group spanning tokens
        (int8 / fp8 and per-token keys encode every token on its own: padding moves nothing there)."""
        return bool(self.sinks or self.smooth or self.codec.unit > 1)

    @property
    def _exact_residual(self) -> bool:
        """Whether the residual holds the tokens as they came (then they are read in place, as views)."""
        return isinstance(self.residual_codec, IdentityCodec)

    @property
    def _reads_as_stored(self) -> bool:
        """Whether this forward reads its own tokens as the residual will hold them: an int8 residual, once the layer
        holds a token. Every read of a token is then the one value the cache keeps of it (its own forward's too), and
        a forward of ``n`` tokens reads what ``n`` one-token forwards read, to the float rounding of its keys and
        values. The prompt's forward (the first into an empty layer) reads itself exactly: its logits equal
        ``DynamicCache``'s and a shared prefill can be handed over."""
        return not self._exact_residual and self.cumulative_length > 0

    def _as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens as an int8 residual holds them: rounded, each row's sinks among them exact (taken here)."""
        codec = self.residual_codec
        rounded_k, rounded_v = torch.empty_like(k), torch.empty_like(v)
        codec.decode(codec.encode(k, v), rounded_k, rounded_v)
        if self.sink is not None:
            first = self.dropped + self.cumulative_length
            self.sink.fill(k, v, first)
            self.sink.patch(rounded_k, rounded_v, first, self.cumulative_length + k.shape[-2])
        return rounded_k, rounded_v

    def _residual_front(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual's oldest ``n`` tokens as K/V (views, or decoded from an int8 residual)."""
        if self._exact_residual:
            return self.residual.view("k")[:, :, :n], self.residual.view("v")[:, :, :n]
        front = {name: t[:, :, :n] for name, t in self.residual.views().items()}
        b, h = self.batch_size, self.spec.num_kv_heads
        k = torch.empty((b, h, n, self.spec.key_dim), dtype=self.dtype, device=self.device)
        v = torch.empty((b, h, n, self.spec.value_dim), dtype=self.dtype, device=self.device)
        self.residual_codec.decode_reference(front, k, v)  # what is encoded again: one decoder on every path
        return k, v

    def _residual_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` / ``v`` at the residual's end in its format (one launch on CUDA)."""
        codec = self.residual_codec
        self.residual.append_written(k.shape[-2], lambda: codec.like(k, v), lambda out: codec.encode_into(k, v, out))

    def _crop_limit_message(self, n: int) -> str:
        return f"cannot crop {n} tokens: this layer holds {self.cumulative_length}"

    def _remove_tail(self, n: int) -> None:
        if n > self.stored_tokens:
            raise ValueError(self._crop_limit_message(n))
        from_res = min(n, self.residual.length)
        self.residual.truncate(from_res)
        rest = n - from_res
        if not rest:
            return
        unit = self.codec.unit
        popped = -(-rest // unit) * unit
        keep = popped - rest
        if keep:
            # Decode the partly removed group; its survivors rejoin the (now empty) residual.
            full_k, full_v = self._decode_all()
            start = self.store.length - popped
            survivors = full_k[:, :, start : start + keep].clone(), full_v[:, :, start : start + keep].clone()
            self.store.truncate(popped)
            self._residual_append(*survivors)
        else:
            self.store.truncate(popped)

    def _decode_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized tokens (not the sinks or the residual), decoded."""
        b, h, t = self.batch_size, self.spec.num_kv_heads, self.store.length
        k = torch.empty((b, h, t, self.spec.key_dim), dtype=self.dtype, device=self.device)
        v = torch.empty((b, h, t, self.spec.value_dim), dtype=self.dtype, device=self.device)
        self.codec.decode(self.store.views(), k, v, self._key_turn())
        if self.key_scale is not None:
            unscale_keys(k, self.key_scale)
        return k, v

    def _store_position(self) -> int:
        """Position (token index in the layer) of the first quantized token."""
        return self.dropped

    def _key_turn(self) -> KeyTurn | None:
        """How the codes' keys turn to their positions as they are decoded: stored before RoPE, from the first
        quantized token's position on (None: stored after RoPE)."""
        return None if self.key_rope is None else (self.key_rope, self._store_position())

    def _cpu_handle_tokens(self) -> int | None:
        """Never where the CPU kernel decodes these codes in one pass (KIVI's uniform float32 codes,
        :mod:`hf_kvcache.kernels.cpu_native`): dequantizing for sdpa then beat the reference kernels' in-place read
        at every length measured (SmolLM2, one thread: int4 / int3 / int2 at 8k x 1 1.25x / 2.1x / 1.8x, at 8k x 4
        1.17x / 2.5x / 2.2x). Else :attr:`CPU_HANDLE_TOKENS`."""
        reads_natively = getattr(self.codec, "reads_natively", None)
        if reads_natively is not None and reads_natively(self.dtype, self.spec.key_dim, self.spec.value_dim,
                                                         self._key_turn()):  # fmt: skip
            return None
        return self.CPU_HANDLE_TOKENS

    def _evict(self) -> None:
        """Full-attention layers keep every token."""

    def _map_batch(self, fn, batch: int | None) -> None:
        if self.is_initialized:
            for buffers in self._parts():
                buffers.map_batch(fn)
            if self.key_scale is not None:
                self.key_scale, self.query_scale = fn(self.key_scale), fn(self.query_scale)
            if self._pads:
                rows = fn(torch.arange(len(self._pads))).tolist()  # the old row each new row comes from
                self._pads = tuple(self._pads[r] for r in rows)
                self._unscaled = tuple(i for i, r in enumerate(rows) if r in self._unscaled)
        self._set_batch(batch)


class QuantizedSlidingWindowLayer(QuantizedLayer):
    """Quantized layer of a model's own sliding-window attention (hybrid models such as Gemma 2/3, Mistral).

    Follows transformers' ``DynamicSlidingWindowLayer`` contract: a forward attends to the last
    ``sliding_window - 1`` tokens plus the new ones, ``get_seq_length`` counts every token seen, and older tokens are
    evicted after the forward (at most ``unit - 1`` extra tokens stay stored, never returned, until their key group
    is evicted whole). While ``generate()`` records the past (assisted decoding), eviction waits for ``crop``.
    """

    is_sliding = True

    def __init__(
        self,
        spec: LayerSpec,
        layer_idx: int,
        owner: str,
        codec,
        residual_length: int,
        workspace: Workspace,
        mode: AttentionMode | None = None,
        key_rope: RotarySpec | None = None,
        residual_codec=None,
        smooth: float = 0.0,
        padding: PaddingTracker | None = None,
    ):
        super().__init__(
            spec, layer_idx, owner, codec, residual_length, workspace, mode, padding=padding, key_rope=key_rope,
            residual_codec=residual_codec, smooth=smooth,
        )  # fmt: skip
        self.sliding_window = spec.sliding_window
        self.record_past = False

    def activate_past_recording(self) -> None:
        self.record_past = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        return min(self.cumulative_length, self.sliding_window - 1) + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def _planned_split(self, tokens: int, prompt: int) -> tuple[int, int]:
        return sliding_encoded_split(tokens, prompt, self.residual_length, self.codec.unit, self.sliding_window)

    def _planned_encodes(self, tokens: int, prompt: int) -> bool:
        """Whether decoding's path encodes a token (its codes may all be evicted since): the prompt's forward, then
        one token per forward until ``tokens`` or until the state repeats (periodic from there without encoding)."""
        shape = (self.residual_length, self.codec.unit, self.sliding_window)
        q, r, encoded = sliding_forward(0, 0, min(prompt, tokens), *shape)
        seen, fed = set(), min(prompt, tokens)
        while not encoded and fed < tokens and (q, r) not in seen:
            seen.add((q, r))
            q, r, encoded = sliding_forward(q, r, 1, *shape)
            fed += 1
        return encoded > 0

    def decode_equivalent_tokens(self, limit: int) -> int:
        """The full layer's rule, and one more: the forward must leave the state decoding leaves. A longer forward
        encodes residual tokens that decoding would have evicted first (and then keeps up to a unit of them past the
        window, read by the next forward), so each length is checked against decoding's steps (:func:`sliding_forward`)
        up to the first step at which decoding encodes. While ``generate()`` records the past (eviction waits for
        ``crop``), one."""
        if self.record_past:
            return 1
        allowed = super().decode_equivalent_tokens(limit)
        q, r = (self.store.length, self.residual.length) if self.is_initialized else (0, 0)
        shape = (self.residual_length, self.codec.unit, self.sliding_window)
        best, dq, dr = 1, q, r
        for n in range(1, allowed + 1):
            dq, dr, encoded = sliding_forward(dq, dr, 1, *shape)
            if sliding_forward(q, r, n, *shape)[:2] == (dq, dr):
                best = n
            if encoded:  # the next token would read this step's codes: decoding's forwards differ from here
                break
        return best

    def _visible_past(self) -> int:
        return min(self.cumulative_length, self.sliding_window - 1)

    def _crop_limit_message(self, n: int) -> str:
        return (
            f"cannot crop {n} tokens: this sliding-window layer holds only the last {self.stored_tokens} of "
            f"{self.cumulative_length} tokens (older ones were evicted from its window)"
        )

    def _evict(self) -> None:
        if self.record_past or not self.is_initialized:
            return
        excess = self.stored_tokens - (self.sliding_window - 1)
        if excess <= 0:
            return
        unit = self.codec.unit
        if excess >= self.store.length:
            from_res = excess - self.store.length
            self.store.clear()
            self.residual.drop_front(from_res)
            self.dropped += excess
        else:
            self.store.drop_front(excess // unit * unit)
            self.dropped += excess // unit * unit
