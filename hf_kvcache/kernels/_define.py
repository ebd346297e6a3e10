"""Defining the project's custom ops on every torch the package supports.

``torch.library.custom_op`` reads an op's schema from its function's annotations. torch 2.6 (the oldest release
transformers 5 runs on) knows ``typing.List[torch.Tensor]`` and ``typing.Optional[torch.Tensor]`` there but not the
spellings this code base writes, ``list[torch.Tensor]`` and ``torch.Tensor | None``: importing the package raised
``ValueError: infer_schema(func): Parameter m has unsupported type list[torch.Tensor]``. :func:`custom_op` hands
torch the older spellings, which every release since reads as the same schema.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Sequence

import torch

__all__ = ["custom_op"]


def _older_spelling(hint):
    """``list[X]`` -> ``typing.List[X]``, ``X | None`` -> ``typing.Optional[X]`` (inside out), a return of ``None``
    (which ``typing.get_type_hints`` turns into ``NoneType``) back to ``None``; anything else as is."""
    if hint is type(None):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return typing.List[_older_spelling(args[0])]  # noqa: UP006 (the spelling torch 2.6 reads)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return typing.Optional[_older_spelling(rest[0])]  # noqa: UP045 (the spelling torch 2.6 reads)
    return hint


def custom_op(name: str, fn: Callable, mutates_args: Sequence[str] = ()):
    """``torch.library.custom_op(name, mutates_args=mutates_args)(fn)`` with ``fn``'s annotations resolved (they are
    strings under ``from __future__ import annotations``) and written in the spellings torch 2.6 reads."""
    fn.__annotations__ = {key: _older_spelling(hint) for key, hint in typing.get_type_hints(fn).items()}
    return torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)
