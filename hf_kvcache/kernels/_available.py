"""Whether the Triton kernels can be used in this process (triton imports and builds for this platform)."""

from __future__ import annotations

import functools

__all__ = ["triton_available"]


@functools.cache
def triton_available() -> bool:
    try:
        from . import triton_decode  # noqa: F401
    except Exception:  # no triton, or one that cannot build for this platform
        return False
    return True
