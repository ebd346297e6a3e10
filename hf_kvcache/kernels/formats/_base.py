"""What every storage format module provides, and what they share.

A format module (:mod:`.dense`, :mod:`.int8`, :mod:`.kivi`, :mod:`.paged`, and the two transforms over them,
:mod:`.rotated` and :mod:`.pre_rope`) owns, for its storage:

* its codec, where a cache layer encodes tokens into it (``encode`` / ``decode`` / ``segment`` /
  ``bytes_per_token``);
* its segment: the frozen view of the stored tensors a layer hands the attention, with ``length``, ``heads``,
  ``value_dim``, ``read_keys`` / ``read_values`` (float32 tokens) and ``scores`` / ``weighted_values`` (what the
  pure-torch reference computes from; a format folds its scales there, as its kernel does);
* its ``hf_kvcache::partial_*`` custom op (:func:`register_partial`; the segment's :meth:`partial` calls it with its
  own arguments);
* its branch of the Triton kernel, described by :meth:`kernel_storage` (the tensors, strides and compile-time switches
  :func:`~hf_kvcache.kernels.triton_decode.triton_partial` passes on), or None for storage the kernel does not read.

So nothing outside a format module asks which format a segment is; adding a format (fp8, say) is one module here and
one ``KIND`` branch in the kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import reference
from .._available import guarded, triton_available

Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Parts = dict[str, torch.Tensor]  # a codec's stored tensors by name

# The storage kinds the Triton kernel branches on (its ``KIND`` compile-time argument).
DENSE, INT8, KIVI, PAGED, PAGED_INT8 = 0, 1, 2, 3, 4


def strides(t: torch.Tensor | None, n: int = 4) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def pool_strides(t: torch.Tensor | None) -> tuple[int, ...]:
    """A block pool ``(slots, H[, D])`` addressed as ``(batch, head, token, channel)``: no batch stride, its slot
    stride as the token stride (zeros for an absent tensor)."""
    if t is None:
        return (0, 0, 0, 0)
    return (0, t.stride(1), t.stride(0), t.stride(2) if t.dim() > 2 else 0)


def channel_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Split the last (channel) axis into groups: ``(B, H, T, D) -> (B, H, T, D / G, G)``."""
    return x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def group_expand(scale: torch.Tensor, width: int) -> torch.Tensor:
    """``(..., D / G)`` per-group scales to ``(..., D)`` per-channel, float32."""
    return scale.float().repeat_interleave(width // scale.shape[-1], dim=-1)


@dataclass(frozen=True)
class KernelStorage:
    """What the Triton decode kernel reads of one segment. Strides are ``(batch, head, token, channel)`` (a block
    pool has no batch stride: its token stride is the slot stride); scale strides likewise."""

    kind: int  # DENSE, INT8, KIVI, PAGED or PAGED_INT8
    k: torch.Tensor
    v: torch.Tensor
    key_dim: int  # channels per head (KIVI rows hold them packed)
    value_dim: int
    length: int
    k_strides: tuple[int, ...]
    v_strides: tuple[int, ...]
    ks: torch.Tensor | None = None
    kz: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    vz: torch.Tensor | None = None
    ks_strides: tuple[int, ...] = (0, 0, 0, 0)
    vs_strides: tuple[int, ...] = (0, 0, 0, 0)
    table: torch.Tensor | None = None  # paged: (B, blocks) block table
    block_size: int = 1
    start: int = 0  # KIVI: first token of the segment in the arrays
    bits: int = 8
    key_group: int = 1
    value_group: int = 1
    fold: bool = False  # one int8 scale per token and head, folded into scores and probabilities
    key_rotation: torch.Tensor | None = None  # (Dk, Dk) float32: codes stored rotated, read in the launch
    value_rotation: torch.Tensor | None = None
    rope: int = 0  # keys stored before RoPE: 1 halves rotate together, 2 interleaved pairs; 0 none
    rotary_dim: int = 0
    first: int = 0  # position of the segment's first token
    inv_freq: torch.Tensor | None = None

    def replace(self, **changes) -> KernelStorage:
        return dataclasses.replace(self, **changes)


class SegmentFormat:
    """Defaults of every segment type (a mixin of the frozen segment dataclasses). Formats name their stored tensors
    alike: ``k`` / ``v`` the keys' and values' data (``(B, H, T, D)``, or a block pool's ``(slots, H, D)``), ``ks`` /
    ``vs`` their scales, ``kz`` / ``vz`` their zero points."""

    @property
    def heads(self) -> int:
        """KV heads."""
        return self.k.shape[1]

    @property
    def value_dim(self) -> int:
        """Channels per head of the values."""
        return self.v.shape[-1]

    ROTATIONS_IN_LAUNCH = False  # its op reads Hadamard-rotated codes in place (the query and output rotated inside)
    ROPE_IN_LAUNCH = False  # its op turns keys stored before RoPE to their positions inside the launch

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``a:b`` as float32 keys ``(B, H, n, Dk)`` and values ``(B, H, n, Dv)``."""
        return self.read_keys(a, b), self.read_values(a, b)

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError

    def read_values(self, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """``(B, Hkv, G, q, n)`` dot products of the grouped float32 query ``(B, Hkv, G, q, Dk)`` with keys ``a:b``
        (unscaled). A format may fold its scales into the query instead of dequantizing every key, as its kernel
        does."""
        return torch.einsum("bhgqd,bhnd->bhgqn", query, self.read_keys(a, b))

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """``(B, Hkv, G, q, Dv)``: ``weights`` ``(B, Hkv, G, q, n)`` times values ``a:b`` (a format may fold its
        scales into the weights)."""
        return torch.einsum("bhgqn,bhnd->bhgqd", weights, self.read_values(a, b))

    def kernel_storage(self) -> KernelStorage | None:
        """What the Triton kernel reads of this segment; None: the kernel does not read it (the reference serves)."""
        return None

    def reference_partial(self, query, mask, scaling, softcap, splits, chunk=None) -> Partials:
        """The contract of :func:`hf_kvcache.kernels.reference.partial` in pure torch, from :meth:`read`."""
        return reference.partial_from_reads(query, self, mask, scaling, softcap, splits, chunk)


class OverSegment(SegmentFormat):
    """A transform over another segment (``inner``): its tokens, heads and value width are the inner segment's."""

    inner: SegmentFormat

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def heads(self) -> int:
        return self.inner.heads

    @property
    def value_dim(self) -> int:
        return self.inner.value_dim


def _fake(query: torch.Tensor, heads: int, value_dim: int, splits: int) -> Partials:
    b, hq, q, _ = query.shape
    shape = (b, heads, hq // heads, q, splits)
    m = query.new_empty(shape, dtype=torch.float32)
    return m, torch.empty_like(m), query.new_empty((*shape, value_dim), dtype=torch.float32)


def triton_or_reference(query, segment, mask, scaling, softcap, splits) -> Partials:
    """On CUDA: the Triton launch when triton imports (it falls back to the reference for storage it does not read)."""

    def ref() -> Partials:
        return reference.partial(query, segment, mask, scaling, softcap, splits)

    if triton_available():
        from ..triton_decode import triton_partial

        name = f"partial:{type(segment).__name__}"
        return guarded(name, lambda: triton_partial(query, segment, mask, scaling, softcap, splits), ref)
    return ref()


def register_partial(name: str, schema_fn, to_segment, heads_and_dim):
    """Define ``hf_kvcache::<name>`` from ``schema_fn`` (the reference, on every device): the Triton kernel on CUDA
    (``to_segment`` turns the op's arguments after the query back into ``(segment, mask, scaling, softcap,
    splits)``; None: a format the Triton kernel does not read runs the reference on CUDA too), and a fake giving
    ``torch.compile`` the output shapes (``heads_and_dim`` of the arguments), so a compiled decode step treats the op
    as one opaque node."""
    op = torch.library.custom_op(f"hf_kvcache::{name}", mutates_args=())(schema_fn)

    @op.register_fake
    def _(*args):
        heads, value_dim = heads_and_dim(*args)
        return _fake(args[0], heads, value_dim, args[-1])

    if to_segment is not None:

        @op.register_kernel("cuda")
        def _(*args):
            return triton_or_reference(args[0], *to_segment(*args[1:]))

    return op
