"""The name a cache travels under, across the transformers releases we support (5.23 and 5.24).

transformers 5.24 renamed the cache argument of every model's ``forward`` and of ``generate`` from
``past_key_values`` to ``cache`` and the outputs' field to ``.cache``. The old argument still works there with a
FutureWarning (until 5.40 for forwards, 6.0 for ``generate``); remote code written for earlier releases keeps the
old name. So the package passes a cache under the name the model takes, reads it back under either, and never
makes a user's call warn.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import transformers
from packaging.version import Version

__all__ = [
    "CACHE_ARG",
    "CACHE_NAMES",
    "TESTED_MINORS",
    "cache_arg",
    "forward_parameters",
    "passed_cache",
    "returned_cache",
    "untested_release",
    "with_cache",
]

# The transformers minors the test suite passes on (pyproject.toml's range says the same). Another minor may move the
# cache API under us: 5.24's rename, unhandled, would have placed sinks on left padding without an error.
TESTED_MINORS = ((5, 23), (5, 24))

# The name transformers' own models and ``generate`` take a cache by in the installed release.
CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"

# Every name a forward may take its cache by, the current first.
CACHE_NAMES = ("cache", "past_key_values")


def forward_parameters(model) -> frozenset[str] | None:
    """The parameter names of ``model.forward``, or None where its signature cannot be read."""
    forward = getattr(model, "forward", None)
    function = getattr(forward, "__func__", forward)  # a bound method is a new object at every access
    try:
        return _parameters_of(function)
    except TypeError:  # unhashable: read it each time
        return _parameters_of.__wrapped__(function)


@functools.lru_cache(maxsize=256)
def _parameters_of(function) -> frozenset[str] | None:
    # read once per forward function: a signature costs ~25 us, which a timed decode step would pay
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def cache_arg(model) -> str | None:
    """The name ``model.forward`` takes its cache by, or None when it takes none (or its signature cannot be read)."""
    parameters = forward_parameters(model) or ()
    return next((name for name in CACHE_NAMES if name in parameters), None)


def with_cache(model, cache) -> dict[str, Any]:
    """``{name: cache}`` for a forward of ``model``: the name its ``forward`` takes (the release's where unreadable)."""
    return {cache_arg(model) or CACHE_ARG: cache}


def passed_cache(kwargs: dict) -> Any:
    """The cache a forward's keyword arguments carry, under either name (None when none)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def returned_cache(outputs) -> Any:
    """The cache a forward's or ``generate``'s output carries, under either name (None when none)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def untested_release(version: str) -> str | None:
    """A one-line warning when transformers ``version`` is not a minor the suite passes on, else None."""
    if Version(version).release[:2] in TESTED_MINORS:
        return None
    tested = " and ".join(".".join(map(str, minor)) for minor in TESTED_MINORS)
    return (
        f"hf_kvcache is tested with transformers {tested}; this is {version}. The cache API moves between minor "
        "releases, and a move can give wrong outputs without an error: install a tested release, or run the suite "
        f"on this one first (scripts/test-transformers.sh {version} in a clone of hf_kvcache)"
    )
