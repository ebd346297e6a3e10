"""Cache kinds by name: a dict, a decorator and one lookup function.

A spec string names a kind and its options: ``"int4:group_size=32:residual_length=64"``. Values are parsed as
int, float, ``true`` / ``false`` / ``none`` or left as strings; an option may appear once. The CLI's ``--caches``
takes the same strings. Each cache module registers its kinds where the cache is defined (:mod:`hf_kvcache.caches`,
which the package imports before anything can look a kind up: this module imports no cache); ``dynamic``
(transformers' ``DynamicCache``, the baseline) is registered here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers import DynamicCache
from transformers.cache_utils import Cache

from ._config import resolve_config

__all__ = ["CacheKind", "available_caches", "check_spec", "make_cache", "parse_spec", "register_cache"]


@dataclass(frozen=True)
class CacheKind:
    name: str
    factory: Callable[..., Cache]  # factory(config, **options) -> Cache
    options: tuple[str, ...]  # option names the spec may set
    summary: str  # one line for listings


_KINDS: dict[str, CacheKind] = {}


def register_cache(name: str, summary: str, options: tuple[str, ...] | None = None):
    """Register ``factory(config, **options)`` under ``name``; options default to the factory's keyword parameters."""

    def decorator(factory: Callable[..., Cache]) -> Callable[..., Cache]:
        if name in _KINDS:
            raise ValueError(f"cache kind {name!r} is already registered")
        opts = options
        if opts is None:
            params = list(inspect.signature(factory).parameters.values())[1:]
            opts = tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        _KINDS[name] = CacheKind(name, factory, opts, summary)
        return factory

    return decorator


def available_caches() -> dict[str, CacheKind]:
    """Registered kinds by name, in registration order."""
    return dict(_KINDS)


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parse_value(text: str):
    """``true`` / ``false`` / ``none``, a plain decimal integer or float (no ``_`` separators, which Python's
    ``int("4_0")`` would read as 40), or the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"int4:group_size=32"`` -> ``("int4", {"group_size": 32})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cache spec must be a non-empty string like 'int4:group_size=32', got {spec!r}")
    name, *parts = spec.strip().split(":")
    options = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"cache spec {spec!r}: option {part!r} must look like name=value")
        key = key.strip()
        if key in options:
            raise ValueError(f"cache spec {spec!r}: option {key!r} is given twice")
        options[key] = _parse_value(value.strip())
    return name.strip(), options


def check_spec(spec: str, **overrides) -> CacheKind:
    """The kind a spec names, after checking its name and option names (no config needed)."""
    name, options = parse_spec(spec)
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown cache kind {name!r} in spec {spec!r}; known kinds: {', '.join(_KINDS)}")
    unknown = sorted((set(options) | set(overrides)) - set(kind.options))
    if unknown:
        allowed = ", ".join(kind.options) or "none"
        raise ValueError(f"cache kind {name!r} has no option {', '.join(unknown)}; its options: {allowed}")
    return kind


def make_cache(spec: str, config, **overrides) -> Cache:
    """Build a cache from a spec string for a model ``config`` (or model); ``overrides`` win over spec options.

    >>> from transformers import LlamaConfig
    >>> make_cache("int4:residual_length=16", LlamaConfig(num_hidden_layers=1, hidden_size=64,
    ...     num_attention_heads=4)).residual_length
    16
    """
    kind = check_spec(spec, **overrides)
    options = parse_spec(spec)[1] | overrides
    return kind.factory(config, **options)  # a model stays a model: some caches hook it (sink padding)


@register_cache("dynamic", "transformers' DynamicCache: full precision, the baseline", options=())
def _dynamic(config) -> Cache:
    return DynamicCache(config=resolve_config(config))
