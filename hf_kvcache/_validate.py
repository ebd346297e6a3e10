"""Argument checks shared by the caches, the harness and the CLI, so every bad value gets the same kind of message:
a ``ValueError`` naming the argument, the value given and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DTYPES", "check_bool", "check_choice", "check_distinct", "check_int", "dtype_from_name", "dtype_name"]

# The floating dtypes a user can name (CLI flags, spec strings, scale dtypes).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_distinct(name: str, values) -> None:
    """Refuse, naming ``name``, a list of options that names one value twice (a cell of documents read twice)."""
    repeated = [v for i, v in enumerate(values) if v in list(values)[:i]]
    if repeated:
        raise ValueError(f"{name} names {repeated[0]!r} twice; name each once")


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a bool, not a float such as ``4.0``) within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum}, got {value!r}")
    return value


def check_choice(name: str, value, allowed: Iterable):
    """``value`` if it is one of ``allowed`` (compared by equality and type, so ``8.0`` is not ``8``)."""
    allowed = tuple(allowed)
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def dtype_from_name(name: str, value: str | torch.dtype, allowed: Iterable[str] = tuple(DTYPES)) -> torch.dtype:
    """The torch dtype ``value`` names (``"bfloat16"``) or is; ``name`` is the argument, for the error."""
    allowed = tuple(allowed)
    if isinstance(value, torch.dtype) and dtype_name(value) in allowed:
        return value
    if isinstance(value, str) and value in allowed:
        return DTYPES[value]
    raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
