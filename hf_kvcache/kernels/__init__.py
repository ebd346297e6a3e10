"""Decode-attention kernels: the launch machinery under the storage formats.

One contract (:mod:`hf_kvcache.kernels.torch_decode`) for reading one segment of a cache layer's storage, two
implementations: a pure-torch reference that runs anywhere with scratch bounded by a chunk, and a Triton kernel for
CUDA (:mod:`hf_kvcache.kernels.triton_decode`) that sees one contract type (:mod:`hf_kvcache.kernels.storage`:
what it reads, and the launch plan) and never asks which format it reads. The split reduction is a custom op
(:mod:`hf_kvcache.kernels.ops`), and so is the append (:mod:`hf_kvcache.kernels.append`). The storage formats, their
segments and the handle a layer passes to attention live above this package, in :mod:`hf_kvcache.formats`; nothing
here imports them.
"""

from ._available import kernel_fallbacks, triton_available
from .append import append_kv
from .ops import combine_partials
from .storage import KernelStorage, LaunchPlan
from .torch_decode import combine, num_splits, partial, torch_attention

__all__ = [
    "KernelStorage",
    "LaunchPlan",
    "append_kv",
    "combine",
    "combine_partials",
    "kernel_fallbacks",
    "num_splits",
    "partial",
    "torch_attention",
    "triton_available",
]
