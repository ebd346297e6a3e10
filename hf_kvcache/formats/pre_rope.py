"""Keys stored before RoPE (``pre_rope=True``, KVQuant): a quantized segment whose token ``t`` sits at position
``first + t``, its key rotated there as it is read. Formats whose op takes the rotary arguments
(``ROPE_IN_LAUNCH``: KIVI, Hadamard-rotated or not) turn each tile of keys in registers inside their launch; other
storage goes to the Triton launch directly on CUDA. Over rotated codes RoPE sits between the rotation and the query,
so the rotation cannot be folded into the query: the kernel rotates each tile of keys back (``x H_k``, one
tensor-core product per tile) before turning it, when the tile is one key group of a power-of-two width with every
channel rotary; the reference serves the other cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import torch_decode
from ..kernels.storage import KernelStorage, LaunchPlan
from ..rope import RotarySpec, rotate_positions
from ._base import OverSegment, Partials, SegmentFormat, launch

__all__ = ["PreRopeSegment"]


@dataclass(frozen=True)
class PreRopeSegment(OverSegment):
    inner: SegmentFormat
    rotary: RotarySpec
    first: int  # position (token index in the layer) of the segment's first token

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return rotate_positions(self.inner.read_keys(a, b), self.first + a, self.rotary)

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self.inner.read_values(a, b)

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.inner.weighted_values(weights, a, b)  # values are stored as they are: the inner format's fold

    def in_launch(self) -> tuple[SegmentFormat, dict]:
        """The stored segment with ``rope`` where its op turns the keys inside its launch; else this segment."""
        return self._in_inner_launch(self.inner.ROPE_IN_LAUNCH, "rope", (self.rotary, self.first))

    def partial_apart(self, query, mask, scaling, softcap, splits) -> Partials:
        if query.is_cuda:  # not a custom op: the Triton launch called directly on CUDA (when triton imports)
            return launch(query, self, mask, scaling, softcap, splits)
        return torch_decode.partial(query, self, mask, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage | None:
        storage = self.inner.kernel_storage()
        if storage is None:
            return None
        inv_freq = self.rotary.inv_freq.to(device=storage.k.device, dtype=torch.float32)
        rope = 2 if self.rotary.interleaved else 1
        return storage.replace(rope=rope, rotary_dim=self.rotary.rotary_dim, first=self.first, inv_freq=inv_freq)

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan | None:
        """The inner format's plan for keys turned as they are read."""
        return self.inner.launch_plan(query, mask, self.rotary.rotary_dim)
