"""Whether the Triton kernels can be used in this process, and what to do where one cannot.

A kernel that this machine's Triton cannot build (an older Triton without a language feature we use, a GPU whose
resources a variant exceeds) must not cost a user their generation: :func:`guarded` runs the reference instead, warns
once, and remembers why (:func:`kernel_fallbacks`: the GPU run reports them)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["fall_back", "fell_back", "guarded", "kernel_fallbacks", "triton_available"]

T = TypeVar("T")
_FALLBACKS: dict[str, str] = {}  # kernel name -> why it could not run here


@functools.cache
def triton_available() -> bool:
    try:
        from . import triton_decode  # noqa: F401
    except Exception:  # no triton, or one that cannot build for this platform
        return False
    return True


def kernel_fallbacks() -> dict[str, str]:
    """The kernels that failed to build or launch in this process, with the error, by name."""
    return dict(_FALLBACKS)


def _build_errors() -> tuple[type[BaseException], ...]:
    """What a Triton kernel raises when it cannot be compiled or launched here (never a CUDA out-of-memory)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (CompilationError, OutOfResources, RuntimeError)


def fell_back(name: str) -> bool:
    """Whether the Triton kernel ``name`` cannot serve in this process (no triton, or it failed here before)."""
    return name in _FALLBACKS or not triton_available()


def fall_back(name: str, err: BaseException) -> None:
    """Record that the Triton kernel ``name`` failed with ``err`` and warn once, if ``err`` is a failure to build or
    launch it here; re-raise anything else (running out of device memory included)."""
    if isinstance(err, torch.cuda.OutOfMemoryError) or not isinstance(err, _build_errors()):
        raise err
    last = str(err).strip().splitlines()[-1:] or [""]  # a compiler's message ends with its verdict
    _FALLBACKS[name] = f"{type(err).__name__}: {last[0][:300]}"
    warnings.warn(
        f"hf_kvcache: the Triton kernel {name} cannot run here ({_FALLBACKS[name]}); using the pure-torch "
        "reference for it",
        RuntimeWarning,
        stacklevel=3,
    )


def guarded(name: str, launch: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``launch()`` (a Triton kernel ``name``), or ``fallback()`` (its pure-torch reference) from the first time it
    fails to build or launch on this machine on: warned once, recorded in :func:`kernel_fallbacks`. Running out of
    device memory is not a build failure and propagates."""
    if name in _FALLBACKS:
        return fallback()
    try:
        return launch()
    except Exception as err:  # noqa: BLE001 (fall_back re-raises what is not a build failure)
        fall_back(name, err)
        return fallback()
