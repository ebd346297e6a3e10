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
* what the Triton kernel reads of it, :meth:`kernel_storage` (a :class:`~hf_kvcache.kernels.storage.KernelStorage`:
  tensors, strides and the storage kind), or None for storage the kernel does not read, and how to launch over it,
  :meth:`launch_plan` (a :class:`~hf_kvcache.kernels.storage.LaunchPlan`: tile, pipelining depth, warps).

The formats sit above :mod:`hf_kvcache.kernels` and import from it, never the other way: the kernels see those two
contract types and nothing else, so nothing outside a format module asks which format a segment is. Adding a format is
one module here (and, for a new way of reading codes, one ``KIND`` branch in the kernel's tile load).
"""

from __future__ import annotations

import torch

from ..kernels import torch_decode
from ..kernels._available import fall_back, fell_back
from ..kernels._define import custom_op
from ..kernels._eager import eager
from ..kernels.storage import MIN_ROWS, KernelStorage, LaunchPlan, block
from ..rope import RotarySpec, rotate_positions

Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Parts = dict[str, torch.Tensor]  # a codec's stored tensors by name
KeyTurn = tuple[RotarySpec, int]  # keys stored before RoPE: the rotation, and the position of the first token


def turn_keys(keys: torch.Tensor, rope: KeyTurn | None) -> None:
    """Decoded keys that were stored before RoPE, turned in place to positions ``first ..`` (``rope``: the rotation
    and ``first``); None: keys stored as the model made them, left as they are. A codec's ``decode`` ends with it
    unless it turns the keys as it writes them."""
    if rope is not None:
        spec, first = rope
        keys.copy_(rotate_positions(keys, first, spec))


def channel_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Split the last (channel) axis into groups: ``(B, H, T, D) -> (B, H, T, D / G, G)``."""
    return x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def group_expand(scale: torch.Tensor, width: int) -> torch.Tensor:
    """``(..., D / G)`` per-group scales to ``(..., D)`` per-channel, float32."""
    return scale.float().repeat_interleave(width // scale.shape[-1], dim=-1)


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

    def launch_input(self, query: torch.Tensor) -> tuple[torch.Tensor, SegmentFormat]:
        """The query and segment a launch reads for this segment: ``(query, self)``. A transform of the query alone
        (smoothed keys, :mod:`.scaled`) gives its inner segment's, with the query transformed first."""
        return query, self

    def in_launch(self) -> tuple[SegmentFormat, dict]:
        """The stored segment whose op reads this one, and the op's extra arguments (a Hadamard rotation's
        ``rotations``, pre-RoPE keys' ``rope``): ``(self, {})`` for a stored segment. Attention calls
        ``segment.partial(..., **extras)`` on what this returns, so a transform read inside its format's launch adds
        no call to the decode step."""
        return self, {}

    def kernel_storage(self) -> KernelStorage | None:
        """What the Triton kernel reads of this segment; None: the kernel does not read it (the reference serves)."""
        return None

    def launch_plan(self, query: torch.Tensor, mask: torch.Tensor | None, rotary_dim: int = 0) -> LaunchPlan | None:
        """How to launch the kernel over this segment for ``query`` (``rotary_dim``: keys stored before RoPE, turned
        per tile); None: the kernel cannot read it this way (the reference serves). The default suits tiles read as
        they are stored: two pipelining stages (three spilled at 4 query tokens for pages, and 20 B at head_dim 96
        on sm_90 for dense tiles, with twice the shared memory for no fewer instructions)."""
        return LaunchPlan(block_n=64, stages=2, warps=plan_warps(query, self.heads, mask, rotary_dim))

    def torch_partial(self, query, mask, scaling, softcap, splits, chunk=None) -> Partials:
        """The contract of :func:`hf_kvcache.kernels.torch_decode.partial` in pure torch, from :meth:`read`."""
        return torch_decode.partial_from_reads(query, self, mask, scaling, softcap, splits, chunk)


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

    def _in_inner_launch(self, read: bool, name: str, value) -> tuple[SegmentFormat, dict]:
        """:meth:`in_launch` of a transform the inner format's op reads as its argument ``name`` (``read``: whether
        it does): the stored segment under every such transform, with each one's argument."""
        if not read:
            return self, {}
        stored, extras = self.inner.in_launch()
        return stored, {**extras, name: value}

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        stored, extras = self.in_launch()
        if stored is not self:  # read in the stored format's own launch
            return stored.partial(query, mask, scaling, softcap, splits, **extras)
        return self.partial_apart(query, mask, scaling, softcap, splits)

    def partial_apart(self, query, mask, scaling, softcap, splits) -> Partials:
        """The partials where the stored format's op does not read this transform."""
        raise NotImplementedError


def plan_warps(query: torch.Tensor, heads: int, mask: torch.Tensor | None, rotary_dim: int) -> int:
    """Warps of a launch: :meth:`LaunchPlan.base_warps`, and eight for keys turned per tile under a causal mask tile
    (pre-RoPE with several query tokens spilled at four on sm_90)."""
    if rotary_dim and mask is not None and query.shape[2] > 1:
        return 8
    return LaunchPlan.base_warps(LaunchPlan.rows(query, heads))


def swapped(query: torch.Tensor, heads: int) -> bool:
    """Whether tiles dequantized in registers enter the products as their first operand (s^T = k q^T,
    acc^T += v^T p^T): while a program holds at most 16 query rows (2-8% fewer main-loop instructions at the 8B shape
    on sm_90, wgmma over the head dimension); with 64 rows (16 query tokens) the swapped tiles spilled."""
    return block(LaunchPlan.rows(query, heads), MIN_ROWS) <= 16


def _fake(query: torch.Tensor, heads: int, value_dim: int, splits: int) -> Partials:
    b, hq, q, _ = query.shape
    shape = (b, heads, hq // heads, q, splits)
    m = query.new_empty(shape, dtype=torch.float32)
    return m, torch.empty_like(m), query.new_empty((*shape, value_dim), dtype=torch.float32)


def launch(query, segment, mask, scaling, softcap, splits, exact: bool = True) -> Partials:
    """The segment through the Triton kernel when triton imports and the kernel builds here: what its format says the
    kernel reads (:meth:`~SegmentFormat.kernel_storage`) and how (:meth:`~SegmentFormat.launch_plan`); the reference
    where either is None, or the kernel cannot run here (warned once, :func:`~hf_kvcache.kernels.kernel_fallbacks`).
    ``exact=False``: the caller combines any number of splits, so the kernel may choose its own count (a custom op's
    fake has fixed the shapes: ``exact``)."""
    name = f"partial:{type(segment).__name__}"
    storage = None if fell_back(name) else segment.kernel_storage()
    plan = None if storage is None else segment.launch_plan(query, mask)
    if plan is not None:
        from ..kernels.triton_decode import triton_partial

        try:
            return triton_partial(query, storage, plan, mask, scaling, softcap, splits, exact)
        except Exception as err:  # noqa: BLE001 (fall_back re-raises what is not a build failure)
            fall_back(name, err)
    return torch_decode.partial(query, segment, mask, scaling, softcap, splits)


def register_partial(name: str, schema_fn, to_segment, heads_and_dim):
    """Define ``hf_kvcache::<name>`` from ``schema_fn`` (the reference, on every device): the Triton kernel on CUDA
    (:func:`launch`; ``to_segment`` turns the op's arguments after the query back into ``(segment, mask, scaling,
    softcap, splits)``; None: a format the Triton kernel does not read runs the reference on CUDA too), and a fake
    giving ``torch.compile`` the output shapes (``heads_and_dim`` of the arguments), so a compiled decode step treats
    the op as one opaque node. Returns what a segment calls: the implementations directly in eager code, the op
    under ``torch.compile`` (:func:`~hf_kvcache.kernels._eager.eager`)."""
    op = custom_op(f"hf_kvcache::{name}", schema_fn)

    @op.register_fake
    def _(*args):
        heads, value_dim = heads_and_dim(*args)
        return _fake(args[0], heads, value_dim, args[-1])

    cuda = None
    if to_segment is not None:

        def cuda(query, *args):
            return launch(query, *to_segment(*args))

        op.register_kernel("cuda")(cuda)
    return eager(op, schema_fn, cuda)
