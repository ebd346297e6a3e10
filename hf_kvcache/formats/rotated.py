"""Hadamard-rotated storage: any quantized format over keys and values rotated by an orthonormal, symmetric transform
of the head dimension (``rotate="hadamard"``: QuaRot, TurboQuant), which spreads an outlier channel over its block.

The codes are read as they are: scores are unchanged with the query rotated, ``q . k = (q H_k) . (k H_k)``, and a
split's accumulator comes out rotated, ``sum_j p_j (v_j H_v) = (sum_j p_j v_j) H_v``, so it is rotated back once per
split (``H_v H_v = I``). Formats whose op takes the rotations (``ROTATIONS_IN_LAUNCH``: int8, KIVI) do both inside
their launch; others get the query rotated and the accumulators rotated back around their own op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import torch_decode
from ..kernels.append import rotate_float32
from ..kernels.storage import KernelStorage, LaunchPlan
from ..rope import angle_table, rotate_positions
from ._base import KeyTurn, OverSegment, Partials, Parts, SegmentFormat

__all__ = ["ROTATIONS", "RotatedCodec", "RotatedSegment", "hadamard", "rotated"]

ROTATIONS = ("hadamard",)


@dataclass(frozen=True)
class RotatedSegment(OverSegment):
    """A quantized segment whose keys and values were stored rotated (``k H_k``, ``v H_v``). :meth:`read` rotates
    the decoded tokens back: the plain reading the in-launch fold is tested against."""

    inner: SegmentFormat
    key_rotation: torch.Tensor  # (Dk, Dk) float32
    value_rotation: torch.Tensor  # (Dv, Dv) float32

    @property
    def value_dim(self) -> int:
        return self.value_rotation.shape[-1]

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return self.inner.read_keys(a, b) @ self.key_rotation

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self.inner.read_values(a, b) @ self.value_rotation

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.inner.scores(query @ self.key_rotation, a, b)  # q . (k H) = (q H) . k, H symmetric

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.inner.weighted_values(weights, a, b) @ self.value_rotation

    @property
    def ROPE_IN_LAUNCH(self) -> bool:  # noqa: N802 (the flag every format has)
        return self.inner.ROTATIONS_IN_LAUNCH and self.inner.ROPE_IN_LAUNCH

    def in_launch(self) -> tuple[SegmentFormat, dict]:
        """The inner segment with ``rotations`` where its op reads rotated codes in place (the query rotated and the
        accumulator rotated back in the same launch); else this segment."""
        rotations = (self.key_rotation, self.value_rotation)
        return self._in_inner_launch(self.inner.ROTATIONS_IN_LAUNCH, "rotations", rotations)

    def partial_apart(self, query, mask, scaling, softcap, splits) -> Partials:
        """The query rotated and the accumulators rotated back around the inner format's own op."""
        return fold_rotation(_inner_partial, query, self, mask, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage | None:
        storage = self.inner.kernel_storage() if self.inner.ROTATIONS_IN_LAUNCH else None
        if storage is None:
            return None
        device = storage.k.device
        return storage.replace(
            key_rotation=self.key_rotation.to(device=device, dtype=torch.float32).contiguous(),
            value_rotation=self.value_rotation.to(device=device, dtype=torch.float32).contiguous(),
        )

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan | None:
        """The inner format's plan. Keys stored before RoPE over rotated codes are rotated back a tile at a time
        (``x H_k``), which needs the tile to be one key group (else None: the reference), and are not pipelined: one
        stage kept four warps free of spills at head_dim 128 on sm_90, where two stages needed eight, a program of
        eight warps per SM, and took 1.4-1.6x the time (H200, 16k and 64k tokens x 8)."""
        plan = self.inner.launch_plan(query, mask, rotary_dim)
        if not rotary_dim or plan is None:
            return plan
        if not plan.group_tiles:
            return None
        return plan.replace(stages=1)

    def torch_partial(self, query, mask, scaling, softcap, splits, chunk=None) -> Partials:
        return fold_rotation(torch_decode.partial, query, self, mask, scaling, softcap, splits, chunk)


def rotate_query(query: torch.Tensor, segment: RotatedSegment) -> torch.Tensor:
    """``query @ H_k`` in float32, back in the query's dtype (the kernels' input)."""
    return (query.float() @ segment.key_rotation).to(query.dtype)


def fold_rotation(partial_fn, query: torch.Tensor, segment: RotatedSegment, *args):
    """``partial_fn`` (any implementation of the contract) over a rotated segment's codes: the query rotated, each
    split's accumulator rotated back."""
    m, l_, acc = partial_fn(rotate_query(query, segment), segment.inner, *args)
    return m, l_, acc @ segment.value_rotation


def _inner_partial(query, segment, mask, scaling, softcap, splits) -> Partials:
    return segment.partial(query, mask, scaling, softcap, splits)


def rotated(inner, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None):
    """``inner`` read through the rotations its codes were stored with (none: as it is)."""
    if key_rotation is None:
        return inner
    return RotatedSegment(inner, key_rotation, value_rotation)


_HADAMARD: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An orthonormal, symmetric ``(width, width)`` Hadamard transform (so it is its own inverse): Sylvester's
    construction on blocks of the largest power of two dividing ``width``, block-diagonal for other widths
    (96 = 3 blocks of 32). Built in float64, cached per width, dtype and device."""
    key = (width, dtype, torch.device(device))
    if key not in _HADAMARD:
        block = width & -width  # the largest power of two dividing width
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < block:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = torch.block_diag(*[h / block**0.5] * (width // block))
        _HADAMARD[key] = h.to(dtype=dtype, device=device)
    return _HADAMARD[key]


_HALVES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _half_transform(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``H_{w/2} / sqrt(2)``: Sylvester's ``H_w`` is ``[[H, H], [H, -H]] / sqrt(2)`` over ``H = H_{w/2}``."""
    key = (width, dtype, torch.device(device))
    if key not in _HALVES:
        _HALVES[key] = hadamard(width // 2, torch.float64, device).mul(0.5**0.5).to(dtype)
    return _HALVES[key]


def _times(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` over every token. A workspace or storage slice ``(B, H, T, ...)`` is contiguous per head but not
    as a whole: matmul would copy it first (its fold to 2-D is a reshape) or fall back to one small product per token
    and head, 4-5x slower on CPU; one batched product per head reads it in place."""
    batched = _per_head(x)
    if batched is None:
        return (x.reshape(-1, x.shape[-1]) @ matrix).view(*x.shape[:-1], matrix.shape[-1])
    out = torch.bmm(batched, matrix.expand(batched.shape[0], *matrix.shape))
    return out.view(*x.shape[:-1], matrix.shape[-1])


def _per_head(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` ``(B, H, ...)`` as a ``(B * H, rows, width)`` view whose rows are contiguous, or None (no such view, or
    ``x`` contiguous: one 2-D product then)."""
    if x.is_contiguous() or x.dim() < 3:
        return None
    try:
        return x.view(x.shape[0] * x.shape[1], -1, x.shape[-1])
    except RuntimeError:
        return None


def _splits(width: int, rope: KeyTurn | None) -> bool:
    """Whether :func:`rotate_back` can take ``x H`` as two half-width products and a butterfly: ``H`` is one
    Sylvester block (a power-of-two width), and keys turned by ``rope`` pair channel ``i`` with ``i + w / 2`` (every
    channel rotary, the ``rotate_half`` layout), the butterfly's own pairs."""
    if width < 2 or width & (width - 1):
        return False
    return rope is None or (not rope[0].interleaved and rope[0].rotary_dim == width)


def rotate_back(x: torch.Tensor, out: torch.Tensor, compute: torch.dtype, rope: KeyTurn | None = None) -> None:
    """``out = x H`` computed in ``compute``, then turned to positions ``first ..`` by ``rope`` (keys stored before
    RoPE); ``x`` and ``out`` may be one tensor.

    In float32, where :func:`_splits`, with ``H' = H_{w/2} / sqrt(2)``, ``a = x_lo H'`` and ``b = x_hi H'``:

    * ``x H = [a + b, a - b]``: half the multiply-adds of ``x H`` (a 32-wide product ran 2x faster than the 64-wide
      one at SmolLM2's shape on CPU);
    * RoPE's turn of that pair by an angle of cosine ``c`` and sine ``s``:
      ``[a (c - s) + b (c + s), a (c + s) - b (c - s)]``, written with the butterfly, not in a pass of its own."""
    width = x.shape[-1]
    # In a 16-bit compute dtype (bfloat16 on CUDA) the full product, whose sums are rounded once: the butterfly would
    # round each half first.
    if compute != torch.float32 or not _splits(width, rope):
        y = _times(x.to(compute), hadamard(width, compute, x.device))
        out.copy_(rotate_positions(y, rope[1], rope[0]) if rope is not None else y)
        return
    halves = _times(x.to(compute).unflatten(-1, (2, width // 2)), _half_transform(width, compute, x.device))
    a, b = halves.unbind(-2)
    lo, hi = out[..., : width // 2], out[..., width // 2 :]
    in_place = out.dtype == compute  # one pass per operation (no out= into views: torch.compile refuses those)
    if rope is None:
        if in_place:
            lo.copy_(a).add_(b)
            hi.copy_(a).sub_(b)
        else:
            lo.copy_(a + b)
            hi.copy_(a - b)
        return
    spec, first = rope
    cos, sin = angle_table(spec.inv_freq, first + x.shape[-2])[first : first + x.shape[-2]].unbind(1)
    minus_sin, plus_sin = cos - sin, cos + sin
    if in_place:
        lo.copy_(a).mul_(minus_sin).addcmul_(b, plus_sin)
        hi.copy_(a).mul_(plus_sin).addcmul_(b, minus_sin, value=-1)
    else:  # rounded to out's dtype once
        lo.copy_(torch.addcmul(a * minus_sin, b, plus_sin))
        hi.copy_(torch.addcmul(a * plus_sin, b, minus_sin, value=-1))


class RotatedCodec:
    """Any codec, applied to keys and values rotated by a Hadamard transform of the head dimension (QuaRot,
    TurboQuant): an outlier channel is spread over every channel of its block before quantizing, and decoding
    rotates back (the transform is orthonormal and symmetric, its own inverse). Stored tensors and bytes are the
    inner codec's. The kernels read the codes in place (:class:`RotatedSegment`): the rotation
    is folded into the query and the attention output, so a decode step adds two small products per layer instead of
    one per cached token."""

    def __init__(self, inner):
        self.inner = inner
        self.unit, self.units = inner.unit, inner.units

    def __getattr__(self, name):  # group_size, bits, key_axis, like, ... of the inner codec (not its encoders)
        if name in ("inner", "encode", "encode_into", "encode_rotated_into", "decode_native"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        """``x H``; float16 in float32 and returned as bfloat16: a rotated channel sums a block of channels, which
        overflows float16 where they are large (codes then get bfloat16 scales, of float32's range)."""
        if x.dtype == torch.float16:
            return _times(x.float(), hadamard(x.shape[-1], torch.float32, x.device)).to(torch.bfloat16)
        return _times(x, hadamard(x.shape[-1], x.dtype, x.device))

    def _rotations(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hadamard(k.shape[-1], torch.float32, k.device), hadamard(v.shape[-1], torch.float32, v.device)

    @property
    def _float32_input(self) -> bool:
        """Whether the inner codec takes the rotated tokens in float32, unrounded: int8, whose append kernel rotates
        them in the launch that encodes them (:meth:`encode_into`)."""
        return getattr(self.inner, "encode_rotated_into", None) is not None

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        if self._float32_input:
            hk, hv = self._rotations(k, v)
            return self.inner.encode(rotate_float32(k, hk), rotate_float32(v, hv))
        return self.inner.encode(self._rotate(k), self._rotate(v))

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        """:meth:`encode` written straight into ``out``: rotated, then the inner codec's own ``encode_into`` (one
        launch on CUDA for int8 and KIVI); int8 with one scale per token and head rotates in that launch too (a
        rotated int8 residual's decode step: one launch, not three). Defined here, not reached through the inner
        codec, which would store the tokens unrotated."""
        if self._float32_input:
            hk, hv = self._rotations(k, v)
            if not self.inner.encode_rotated_into(k, v, out, hk, hv):
                self.inner.encode_into(rotate_float32(k, hk), rotate_float32(v, hv), out)
            return
        self.inner.encode_into(self._rotate(k), self._rotate(v), out)

    def reads_natively(self, dtype: torch.dtype, key_dim: int, value_dim: int, rope: KeyTurn | None) -> bool:
        """Whether the inner codec's CPU kernel decodes and rotates back in one pass (KIVI's)."""
        inner = getattr(self.inner, "reads_natively", None)
        return inner is not None and inner(dtype, key_dim, value_dim, rope, rotate=True)

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None = None) -> None:
        """The inner codec's tokens rotated back, keys stored before RoPE turned to their positions in the same pass
        (:func:`rotate_back`). Decoded in float32 where the K/V are float16 (a rotated token may not fit float16);
        rotated back in float32 there and on the CPU (whose 16-bit products run ~20x slower than float32's), else in
        the K/V dtype."""
        native = getattr(self.inner, "decode_native", None)  # the CPU kernel undoes the rotation in its pass
        if native is not None and native(parts, k_out, v_out, rope, rotate=True):
            return
        self.decode_reference(parts, k_out, v_out, rope)

    def decode_reference(
        self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None = None
    ) -> None:
        """:meth:`decode` in torch, never by the CPU kernel: what a layer encodes again (an int8 residual's tokens
        leaving for the codes) must not depend on which decoder ran, and the kernel's butterfly differs from torch's
        products in the last bit, enough to move a code that sits on a boundary."""
        wide = k_out.dtype == torch.float16
        k_dec = torch.empty(k_out.shape, device=k_out.device) if wide else k_out
        v_dec = torch.empty(v_out.shape, device=v_out.device) if wide else v_out
        self.inner.decode(parts, k_dec, v_dec)
        compute = torch.float32 if wide or k_out.device.type == "cpu" else k_out.dtype
        rotate_back(k_dec, k_out, compute, rope)
        rotate_back(v_dec, v_out, compute)

    def segment(self, parts: Parts, start: int = 0) -> RotatedSegment:
        inner = self.inner.segment(parts, start)
        device, (dk, dv) = parts["k"].device, (self.inner.width(parts, name) for name in ("k", "v"))
        return RotatedSegment(inner, hadamard(dk, torch.float32, device), hadamard(dv, torch.float32, device))

    def bytes_per_token(self, *args, **kwargs) -> float:
        return self.inner.bytes_per_token(*args, **kwargs)
