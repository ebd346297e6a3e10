"""Per-layer key widths: a width for each decoder layer's keys, as a list or a JSON file that
:func:`hf_kvcache.calibrate.search_key_bits` writes and ``QuantizedKVCache(key_bits=...)`` (spec
``int2:key_bits=widths.json``) reads.

The file is the search's whole record: the widths a cache needs, and how they were chosen (the model, the budget, the
calibration text's size and each layer's measured sensitivity), so a reader can tell what a saved file was fitted to.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["KEY_WIDTHS", "LayerKeyWidths", "check_budget", "resolve_key_bits"]

KEY_WIDTHS = (4, 3, 2)  # the KIVI widths a layer's keys can take
_FORMAT = "hf_kvcache.key_bits/1"


@dataclass(frozen=True)
class LayerKeyWidths:
    """Each decoder layer's key width (``key_bits[i]`` for layer ``i``), with how they were chosen.

    ``sensitivity[i][str(b)]``: the calibration loss (mean KL divergence of next-token distributions from the
    full-precision cache's, nats per token) with layer ``i``'s keys at ``b`` bits and every other layer's at the
    widest width searched; ``baseline``: the same with every layer at the widest.
    """

    key_bits: tuple[int, ...]
    bits: int  # the values' width the widths were searched beside
    budget: float  # average key bits per key element the search was allowed
    model_type: str = ""
    calibration_tokens: int = 0
    calibration_rows: str = ""  # what the rows were: "text" (the dataset's) or "random tokens"; "" unrecorded
    scored_tokens: int = 0
    baseline: float = 0.0
    sensitivity: tuple[dict[str, float], ...] = field(default_factory=tuple)
    key_elements: tuple[int, ...] = field(default_factory=tuple)  # key elements per token of each layer

    def __post_init__(self):
        object.__setattr__(self, "key_bits", _check_widths("key_bits", self.key_bits))
        object.__setattr__(self, "sensitivity", tuple(self.sensitivity))
        object.__setattr__(self, "key_elements", tuple(self.key_elements))
        if self.sensitivity and len(self.sensitivity) != len(self.key_bits):
            raise ValueError(f"sensitivity has {len(self.sensitivity)} layers, key_bits {len(self.key_bits)}")

    def with_budget(self, budget: float) -> LayerKeyWidths:
        """The widths with the least summed measured loss whose key bits stay within ``budget`` bits per key element
        on average, from this record's measurements (no model run): a knapsack over the layers (each layer's loss
        above the baseline taken as additive), solved exactly by dynamic programming in units of the layers' common
        number of key elements. Ties go to fewer bits."""
        if not self.sensitivity:
            raise ValueError("with_budget needs the measurements of a search (this record has no sensitivity)")
        widths = sorted(int(w) for w in self.sensitivity[0])
        check_budget(budget, widths)
        elements = self.key_elements or (1,) * len(self.key_bits)
        unit = math.gcd(*elements)
        sizes = [e // unit for e in elements]
        low = widths[0]
        capacity = math.floor((budget - low) * sum(sizes) + 1e-9)  # bits above the narrowest, in units
        best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}  # units used -> (summed loss, widths)
        for row, size in zip(self.sensitivity, sizes):
            step: dict[int, tuple[float, tuple[int, ...]]] = {}
            for used, (total, chosen) in best.items():
                for width in widths:
                    cost = used + (width - low) * size
                    if cost <= capacity and (cost not in step or total + row[str(width)] < step[cost][0] - 1e-12):
                        step[cost] = (total + row[str(width)], (*chosen, width))
            best = step
        _, (_, chosen) = min(best.items(), key=lambda item: (item[1][0], item[0]))
        return replace(self, key_bits=chosen, budget=float(budget))

    @classmethod
    def from_dict(cls, record: dict) -> LayerKeyWidths:
        """The record :meth:`to_dict` (or a saved file) holds."""
        record = {k: v for k, v in record.items() if k != "format"}
        return cls(**record)

    def to_dict(self) -> dict:
        return {"format": _FORMAT, **asdict(self)}

    @property
    def mean_bits(self) -> float:
        """Average key width over layers (per key element where every layer has the same key heads and width)."""
        return sum(self.key_bits) / len(self.key_bits)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the record as JSON; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> LayerKeyWidths:
        """Read a record :meth:`save` wrote; a missing file or another format is a ``ValueError`` naming the path."""
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"key_bits: no file {str(path)!r} (key_bits takes a width, 4, 3 or 2, a width per layer, or a widths "
                "file written by hf-kvcache calibrate)"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(f"key_bits: {str(path)!r} is not JSON ({err})") from None
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            raise ValueError(f"key_bits: {str(path)!r} is not a per-layer key widths file (format {_FORMAT!r})")
        try:
            return cls.from_dict(record)
        except TypeError as err:
            raise ValueError(f"key_bits: {str(path)!r} has unexpected fields ({err})") from None


def check_budget(budget, widths: list[int]) -> float:
    """``budget`` if it is a number of bits between the narrowest and widest of the sorted ``widths``."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not widths[0] <= budget <= widths[-1]:
        raise ValueError(f"budget must be a number of bits between {widths[0]} and {widths[-1]}, got {budget!r}")
    return budget


def _check_widths(name: str, widths) -> tuple[int, ...]:
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths:
        raise ValueError(f"{name} must be a non-empty sequence of widths (4, 3 or 2), one per layer, got {widths!r}")
    for i, w in enumerate(widths):
        if isinstance(w, bool) or w not in KEY_WIDTHS or not isinstance(w, int):
            raise ValueError(f"{name}[{i}] must be one of 4, 3, 2, got {w!r}")
    return tuple(widths)


def resolve_key_bits(key_bits, num_layers: int) -> int | tuple[int, ...] | None:
    """``QuantizedKVCache``'s ``key_bits`` as an int (one width for every layer), a tuple (one per layer) or ``None``
    (the values' width): a width, a sequence of ``num_layers`` widths, a :class:`LayerKeyWidths` or the path of a file
    it saved. A per-layer list whose widths are all equal is that one width."""
    if key_bits is None:
        return None
    if isinstance(key_bits, int) and not isinstance(key_bits, bool):
        if key_bits not in KEY_WIDTHS:
            raise ValueError(f"key_bits must be one of 4, 3, 2 (or one per layer), got {key_bits!r}")
        return key_bits
    if isinstance(key_bits, (str, os.PathLike)):
        key_bits = LayerKeyWidths.load(key_bits)
    widths = key_bits.key_bits if isinstance(key_bits, LayerKeyWidths) else _check_widths("key_bits", key_bits)
    if len(widths) != num_layers:
        raise ValueError(
            f"key_bits gives {len(widths)} per-layer widths for a model of {num_layers} decoder layers: a widths list "
            "or file must be made for this model"
        )
    return widths[0] if len(set(widths)) == 1 else widths
