"""torch releases: the package's custom ops are defined in the annotation spellings torch 2.6 reads (transformers 5's
floor, and ours), with the schemas newer releases infer; pyproject's floor is transformers'.

The whole suite on another release: ``scripts/test-torch.sh VERSION`` (what it gave on 2.15.0, 2.14.1, 2.11.0, and
in part on 2.6.0: docs/api.md, "torch releases")."""

from __future__ import annotations

import importlib.metadata
import re
import typing
from pathlib import Path

import pytest
import torch

from hf_kvcache.kernels._define import custom_op

ROOT = Path(__file__).resolve().parent.parent


def _modern(m: list[torch.Tensor], sinks: torch.Tensor | None, out: torch.Tensor, n: int) -> None:
    out.copy_(m[0] if sinks is None else sinks)


def test_custom_op_hands_torch_the_older_spellings_and_keeps_the_schema():
    def fn(m: list[torch.Tensor], sinks: torch.Tensor | None, out: torch.Tensor, n: int) -> None:
        out.copy_(m[0] if sinks is None else sinks)

    op = custom_op("hf_kvcache_test::older_spellings", fn, mutates_args=("out",))
    hints = fn.__annotations__
    assert hints["m"] == typing.List[torch.Tensor]  # noqa: UP006
    assert hints["sinks"] == typing.Optional[torch.Tensor]  # noqa: UP045
    assert hints["n"] is int and hints["return"] is None
    schema = "(Tensor[] m, Tensor? sinks, Tensor(a2!) out, SymInt n) -> ()"
    assert str(op._opoverload._schema) == f"hf_kvcache_test::older_spellings{schema}"
    try:  # torch 2.6 cannot read the modern spellings at all (the reason for custom_op)
        modern = torch.library.infer_schema(_modern, mutates_args=("out",))
    except ValueError:
        modern = None
    assert modern in (None, schema)
    out = torch.zeros(2)
    op([torch.ones(2)], None, out, 1)
    assert out.tolist() == [1.0, 1.0]


def test_every_op_of_the_package_is_defined():
    import hf_kvcache  # noqa: F401 (defines the ops)

    names = {"append_kv", "combine", "encode_kivi", "partial_dense", "partial_fp8", "partial_int8", "partial_kivi",
             "partial_kivi_token", "partial_paged"}  # fmt: skip
    for name in names:
        schema = str(getattr(torch.ops.hf_kvcache, name).default._schema)
        assert schema.startswith(f"hf_kvcache::{name}("), schema


def _floor(requirements: list[str]) -> str:
    for requirement in requirements:
        match = re.fullmatch(r"torch>=([\d.]+)(;.*)?", requirement.replace(" ", ""))
        if match:
            return match.group(1)
    pytest.fail(f"no torch>= requirement among {requirements}")


def test_the_torch_floor_is_transformers_floor():
    """Below transformers' floor transformers disables torch (and every model); above it users on a release
    transformers supports are refused for nothing. A test fails when transformers moves its floor."""
    ours = _floor(re.findall(r'"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text()))
    theirs = _floor(importlib.metadata.requires("transformers") or [])
    assert ours == theirs, (ours, theirs)
