"""A clear refusal, at load, of models that build their attention from their own classes.

A few modeling files (GPT-J, GPT-Neo, Falcon, GIT, ...) pick an attention class from a module-level dict keyed by
``config._attn_implementation`` instead of calling transformers' ``AttentionInterface``. Loaded with
``attn_implementation="hf_kvcache"`` (a registered name, so transformers accepts it), they died with
``KeyError: 'hf_kvcache'`` inside their constructor. :func:`install` gives each such dict one more key, ours, whose
class refuses in one line that says what to load instead; no other attention name's entry is touched. Dicts of
modeling modules imported later get it as they are imported (a finder that runs after the module's own code).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["install"]

_PREFIX = "transformers.models."


def _refusal(module_name: str, dict_name: str, attention: str) -> type:
    model_type = module_name.removeprefix(_PREFIX).split(".")[0]

    class RefusesHfKvcacheAttention:
        def __init__(self, *args, **kwargs):
            raise ValueError(
                f"model_type {model_type!r} builds its attention from its own classes ({dict_name}), not through "
                f"transformers' AttentionInterface, so attn_implementation={attention!r} cannot serve it; load it "
                "with 'sdpa' or 'eager', which every hf_kvcache cache serves"
            )

    return RefusesHfKvcacheAttention


_NAMES: list[str] = []  # the attention names given a refusing class


def _add_keys(module: ModuleType) -> None:
    for name, value in list(vars(module).items()):
        if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict) and "eager" in value:
            for attention in _NAMES:
                value.setdefault(attention, _refusal(module.__name__, name, attention))


def _is_modeling(name: str) -> bool:
    return name.startswith(_PREFIX) and name.rpartition(".")[2].startswith("modeling_")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _add_keys(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the file loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not _is_modeling(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def install(attention: str) -> None:
    """Give ``attention`` a refusing class in every legacy attention dict, now and in modules imported later
    (idempotent)."""
    if attention not in _NAMES:
        _NAMES.append(attention)
    for name, module in list(sys.modules.items()):
        if module is not None and _is_modeling(name):
            _add_keys(module)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
