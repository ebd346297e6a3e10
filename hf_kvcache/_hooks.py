"""One forward pre-hook per model, shared by every cache built from that model.

transformers hands a cache layer keys and values only. Caches that need more of a forward (the attention mask, to
know each row's left padding) are told by this hook: it runs before every forward of the model and, when the forward
is passed one of our caches (as ``cache``, or as ``past_key_values``: transformers before 5.24, remote code, a
caller's deprecated spelling), calls that cache's ``before_forward(kwargs)``. Forwards with any other cache (or none)
cost two dictionary lookups.

The hook holds no reference to any cache. It is registered when the first cache is built from a model and removed
when the last such cache is garbage collected, so a thousand live caches still mean one hook.
"""

from __future__ import annotations

import weakref

import torch

from ._compat import passed_cache

__all__ = ["ForwardObserver", "hook_count", "observe_forwards"]


class ForwardObserver:
    """Mixin of the caches the model hook reports to."""

    def before_forward(self, kwargs: dict) -> None:
        raise NotImplementedError


class _ModelHook:
    def __init__(self, model: torch.nn.Module):
        self.handle = model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        self.caches = 0


_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, _ModelHook] = weakref.WeakKeyDictionary()


def _before_forward(module, args, kwargs):
    cache = passed_cache(kwargs)
    if isinstance(cache, ForwardObserver):
        cache.before_forward(kwargs)


def _release(model_ref: weakref.ref) -> None:
    model = model_ref()
    hook = _HOOKS.get(model) if model is not None else None
    if hook is None:
        return
    hook.caches -= 1
    if hook.caches == 0:
        hook.handle.remove()
        del _HOOKS[model]


def observe_forwards(model: torch.nn.Module, cache: ForwardObserver) -> None:
    """Report ``model``'s forwards that are passed ``cache`` to ``cache.before_forward`` (for the cache's life)."""
    hook = _HOOKS.get(model)
    if hook is None:
        hook = _HOOKS[model] = _ModelHook(model)
    hook.caches += 1
    weakref.finalize(cache, _release, weakref.ref(model))


def hook_count(model: torch.nn.Module) -> int:
    """Live caches reporting through ``model``'s hook (0: no hook)."""
    hook = _HOOKS.get(model)
    return hook.caches if hook is not None else 0
