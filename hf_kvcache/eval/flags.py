"""Command-line flags generated from config dataclasses, so a config and its CLI cannot drift.

Each dataclass field becomes ``--field-name`` with the field's ``metadata["help"]`` and its default in the help text.
Types: ``int``, ``float``, ``str``, ``bool`` (a switch), ``X | None``, and tuples (``tuple[int, ...]``: one
comma-separated value, ``--lengths 256,1024``), with ``metadata["choices"]`` where the values are a closed list.
Flags are parsed into only the fields given on the command line, so the dataclass keeps its own defaults and a caller
can tell which flags were set. (transformers' ``HfArgumentParser`` was the other choice; it maps lists to
space-separated ``nargs="+"`` values and has no comma-separated tuples, which our ``--caches`` and ``--contexts``
have always taken.)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

__all__ = ["add_flags", "check_flag_type", "flag_name", "given_fields"]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(annotation):
    """``(type, is_tuple)`` of a field annotation, with ``X | None`` unwrapped."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _tuple_parser(item_type, name: str):
    def parse(text: str):
        try:
            values = tuple(item_type(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag_name(name)} must be comma-separated {item_type.__name__} values, got {text!r}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag_name(name)} must name at least one value, got {text!r}")
        return values

    return parse


def check_flag_type(what: str, annotation) -> None:
    """Raise ``ValueError`` when a field's type cannot be a flag (int, float, str, bool, ``X | None``, tuples)."""
    kind, _ = _base_type(annotation)
    if kind not in (int, float, str, bool):
        raise ValueError(f"{what}: type {annotation} cannot be a flag (int, float, str, bool, X | None, tuple[X, ...])")


_METAVARS = {
    (int, False): "N",
    (float, False): "X",
    (int, True): "N,N,...",
    (float, True): "X,X,...",
    (str, True): "A,B,...",
}


def _default_text(value) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls,
    skip: tuple[str, ...] = (),
    helps: dict[str, str] | None = None,
) -> list[str]:
    """Add a flag per field of dataclass ``cls`` (fields declared on ``cls`` itself, not inherited, none in
    ``skip``); returns the field names added. ``helps`` replaces the help of the named fields. A field without
    ``metadata["help"]`` is an error: every flag says what it does."""
    hints = typing.get_type_hints(cls)
    own = [f for f in dataclasses.fields(cls) if f.name in vars(cls).get("__annotations__", {}) and f.name not in skip]
    for f in own:
        help_text = (helps or {}).get(f.name) or f.metadata.get("help")
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} has no metadata['help'] for its flag")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind, is_tuple = _base_type(hints[f.name])
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS}
        if kind is bool and not is_tuple:
            kwargs["action"] = "store_true"
            parser.add_argument(flag_name(f.name), help=f"{help_text} (default: off)", **kwargs)
            continue
        kwargs["type"] = _tuple_parser(kind, f.name) if is_tuple else kind
        if "choices" in f.metadata and not is_tuple:
            kwargs["choices"] = f.metadata["choices"]
        kwargs["metavar"] = f.metadata.get("metavar") or _METAVARS.get((kind, is_tuple), f.name.upper())
        if "(default" not in help_text:  # a help that explains its own default keeps it
            help_text = f"{help_text} (default: {_default_text(default)})"
        parser.add_argument(flag_name(f.name), help=help_text, **kwargs)
    return [f.name for f in own]


def given_fields(namespace: argparse.Namespace, names: list[str]) -> dict:
    """The fields among ``names`` that were given on the command line."""
    return {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}
