"""Calling the project's custom ops from eager code without the dispatcher.

Every kernel is a ``torch.library`` custom op so that ``torch.compile`` keeps it as one opaque graph node (its fake
implementation gives the shapes). Called eagerly, the op costs its Python wrappers (autograd, the backend's wrapper,
the aliasing check): 60-90 µs a call on an H200 machine's host, more than the device takes for a 4k-token layer's
whole decode step (13-50 µs), where a step is issued in 240-1,500 µs. :func:`eager` calls the implementation for the
tensors' device directly, and the op while ``torch.compile`` traces."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

__all__ = ["dispatching", "eager", "through_ops"]

_THROUGH_OPS = [False]


@contextlib.contextmanager
def through_ops() -> Iterator[None]:
    """Within it, eager calls go through the custom ops too, as compiled code's do: what a dispatcher-level observer
    (the GPU report's launch counter) must see, one op per kernel launch, not the reference's operations on CPU."""
    before = _THROUGH_OPS[0]
    _THROUGH_OPS[0] = True
    try:
        yield
    finally:
        _THROUGH_OPS[0] = before


def dispatching() -> bool:
    """Whether calls must reach the custom ops: while ``torch.compile`` traces, or within :func:`through_ops`."""
    return _THROUGH_OPS[0] or torch.compiler.is_compiling()


def _device(first) -> torch.device:
    return (first if isinstance(first, torch.Tensor) else first[0]).device


def eager(op, torch_impl: Callable, cuda: Callable | None = None) -> Callable:
    """``op`` as the code above the kernels calls it: ``cuda(*args)`` when the first argument (or the first tensor
    of a list) is on a CUDA device, with that device current as the dispatcher would make it, ``torch_impl(*args)``
    (the pure-torch reference) elsewhere, and ``op(*args)`` under ``torch.compile`` (``.op`` on the result). Both
    implementations are the ones the op registers, so the two paths compute the same thing."""

    def call(*args):
        if dispatching():
            return op(*args)
        if cuda is not None:
            device = _device(args[0])
            if device.type == "cuda":
                if device.index is not None and device.index != torch.cuda.current_device():
                    with torch.cuda.device(device):
                        return cuda(*args)
                return cuda(*args)
        return torch_impl(*args)

    functools.update_wrapper(call, torch_impl)
    call.op = op
    return call
