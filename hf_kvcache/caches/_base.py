"""What every hf_kvcache cache shares: reading the model it serves, memory reporting, reset, and the hook that tells a
cache about its forwards."""

from __future__ import annotations

import copy
import weakref

import torch
from transformers.cache_utils import Cache

from .._config import (
    LayerSpec,
    is_latent_attention,
    layer_specs,
    layers_read_in_place,
    model_type,
    resolve_config,
    tensor_parallel_size,
)
from .._hooks import ForwardObserver, observe_forwards
from ..layers._common import AttentionMode, PaddingTracker

__all__ = ["KVCacheReportMixin", "PaddingObserverMixin", "load_cache", "split_model"]


def _describe(specs: list[LayerSpec], i: int) -> str:
    if i >= len(specs):
        return "none"
    s = specs[i]
    return f"{s.layer_type}, {s.num_kv_heads} KV heads of widths {s.key_dim} / {s.value_dim}"


def split_model(config_or_model) -> tuple[torch.nn.Module | None, object]:
    """A cache's first argument as ``(model or None, its config)``: built from a model, a cache also reads its RoPE,
    tensor-parallel plan and attention implementation, and observes its forwards."""
    model = config_or_model if isinstance(config_or_model, torch.nn.Module) else None
    return model, resolve_config(config_or_model)


class KVCacheReportMixin:
    """Memory reporting shared by the hf_kvcache caches (layers expose ``nbytes`` / ``reserved_nbytes``)."""

    layers: list

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage holding live tokens now: data, scales, zero points, residual, block tables; and a
        hybrid model's recurrent / convolution states (:attr:`state_nbytes`), as ``DynamicCache`` holds them."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def state_nbytes(self) -> int:
        """Bytes of a hybrid model's recurrent / convolution states (0 for attention-only models): a fixed size per
        row, the same in every cache, counted in :attr:`nbytes`; ``hf-kvcache plan`` adds them per row apart from its
        per-token K/V (:func:`hf_kvcache.plan.state_bytes`)."""
        return sum(getattr(layer, "state_nbytes", 0) for layer in self.layers)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated now, including growth headroom (``>= nbytes``)."""
        return sum(layer.reserved_nbytes for layer in self.layers)

    @property
    def workspace_nbytes(self) -> int:
        """Scratch shared by all layers for the K/V handed to attention (one layer's worth, not per layer)."""
        workspace = getattr(self, "workspace", None)
        return workspace.nbytes if workspace is not None else 0

    def memory_report(self) -> dict:
        """Totals and a per-layer breakdown (``layer_idx``, ``type``, ``stored_tokens``, ``nbytes``, ...)."""
        rows = [
            {
                "layer_idx": i,
                "type": type(layer).__name__,
                "seen_tokens": layer.get_seq_length(),
                "stored_tokens": layer.stored_tokens,
                "nbytes": layer.nbytes,
                "reserved_nbytes": layer.reserved_nbytes,
            }
            for i, layer in enumerate(self.layers)
        ]
        return {
            "nbytes": self.nbytes,
            "state_nbytes": self.state_nbytes,
            "reserved_nbytes": self.reserved_nbytes,
            "workspace_nbytes": self.workspace_nbytes,
            "layers": rows,
        }

    def reset(self) -> None:
        """Back to the freshly constructed state: every layer releases its storage (and the shared workspace is
        freed), so the next forward may bring any batch size, dtype and device. See the lifecycle contract in
        :mod:`hf_kvcache.layers._common`."""
        Cache.reset(self)
        workspace = getattr(self, "workspace", None)
        if workspace is not None:
            workspace.clear()
        padding = getattr(self, "padding", None)
        if padding is not None:
            padding.reset()


class PaddingObserverMixin(ForwardObserver):
    """Caches that need each row's left padding: built from a model, they read it from the attention mask of every
    forward they are passed (one shared hook per model, :mod:`hf_kvcache._hooks`)."""

    padding: PaddingTracker
    _needs_model = False  # loaded from a file, not yet attached: refuses forwards (the instance's, once set)

    def _bind_model(self, model: torch.nn.Module | None, config) -> list[LayerSpec]:
        """What every cache takes from the model it serves once its own arguments are checked: each layer's spec
        (``layer_specs``, refusing what no cache can serve), the attention mode, an empty padding tracker."""
        specs = layer_specs(config, type(self).__name__, tensor_parallel_size(model), model)
        read = layers_read_in_place(config)
        unreadable = [i for i in read if specs[i].holds_kv and not self._keeps_tensors(specs[i])]
        if unreadable:
            raise ValueError(
                f"{type(self).__name__} cannot serve model_type {model_type(config)!r} with "
                f"recurrent_kv_cache_mode='last_loop': its earlier recurrent loops read layer {unreadable[0]}'s stored "
                f"keys and values as tensors (cache.layers[{unreadable[0]}].keys), which this cache keeps in its own "
                "layout; load the model with recurrent_kv_cache_mode='per_loop' (its default: a cache layer per loop, "
                "which every hf_kvcache cache serves)"
            )
        self.layer_specs = specs
        self.padding = PaddingTracker()
        self.attention_mode = AttentionMode(config, fusable=not is_latent_attention(config), model=model)
        self._built_from_model = model is not None
        return specs

    def _keeps_tensors(self, spec: LayerSpec) -> bool:
        """Whether this cache's layer for ``spec`` keeps the model's keys and values as ``keys`` / ``values`` tensors,
        as ``DynamicCache``'s do (a model may read them in place: :func:`~hf_kvcache._config.layers_read_in_place`)."""
        return False

    def _observe_model(self, model: torch.nn.Module | None) -> None:
        self._observed_model = None if model is None else weakref.ref(model)
        if model is not None:
            observe_forwards(model, self)

    def _observe_again(self) -> None:
        """A copy reports to its own account of the model's hook: without it, the hook is removed once the
        original is collected, and the copy stops hearing about left padding."""
        ref = self.__dict__.get("_observed_model")
        model = ref() if ref is not None else None
        if model is not None:
            observe_forwards(model, self)

    # -- a cache saved and loaded (pickle, torch.save / torch.load, another process) ----------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # The model is not part of a saved cache: the loaded one serves the tokens it holds once attach(model) has
        # given it back the model's config (read at every forward) and forwards (each prefill's left padding).
        state["_observed_model"] = None
        state["_needs_model"] = self.__dict__.get("_built_from_model", False)
        return state

    def attach(self, model: torch.nn.Module) -> None:
        """Serve ``model``: what a cache loaded from a file (``torch.load``, ``pickle``: the model is not saved with
        it) needs before its next forward, and what a cache built from a config may be given to read each prefill's
        left padding itself. ``model`` must have the layers the cache was built for (model type, layer types, heads
        and widths)."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be the torch.nn.Module the cache serves, got {type(model).__name__}")
        config = resolve_config(model)
        specs = layer_specs(config, type(self).__name__, tensor_parallel_size(model), model)
        if specs != self.layer_specs:
            pairs = zip(specs, self.layer_specs)
            differ = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(specs), len(self.layer_specs)))
            raise ValueError(
                f"model: this {type(self).__name__} was built for {len(self.layer_specs)} layers of model_type "
                f"{self.attention_mode.model_type!r}; {type(model).__name__} (model_type {model_type(config)!r}) has "
                f"{len(specs)}, and layer {differ} differs ({_describe(specs, differ)} against "
                f"{_describe(self.layer_specs, differ)}): attach the model the cache was built from"
            )
        self.attention_mode.bind(config, model)
        observed = self.__dict__.get("_observed_model")
        if observed is None or observed() is not model:
            self._observe_model(model)
        self._built_from_model = True
        self._needs_model = False

    def _check_attached(self) -> None:
        if self._needs_model:
            raise ValueError(
                f"this {type(self).__name__} was loaded without its model (a saved cache does not hold the model): "
                "call cache.attach(model) with the model it was built from before its next forward, or load it with "
                "hf_kvcache.load_cache(path, model)"
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._check_attached()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, *args, **kwargs):
        self._check_attached()  # a forward builds its masks before its first layer stores anything
        return super().get_mask_sizes(*args, **kwargs)

    def __copy__(self):
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        clone._observe_again()
        return clone

    def __deepcopy__(self, memo: dict):
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            clone.__dict__[name] = copy.deepcopy(value, memo)  # the model's weakref is copied as itself
        clone._observe_again()
        return clone

    def before_forward(self, kwargs: dict) -> None:
        self.padding.observe(kwargs.get("attention_mask"))


def load_cache(f, model: torch.nn.Module):
    """A cache saved with ``torch.save(cache, f)`` (any hf_kvcache cache, prefilled or not), attached to ``model``
    and ready to continue: ``model.generate(..., past_key_values=load_cache(f, model))`` continues as the saved cache
    would have. ``f``: a path or file object, as ``torch.load`` takes. The file is a pickle: load only files you
    trust. It loads onto the device it was saved from.
    """
    cache = torch.load(f, weights_only=False)
    if not isinstance(cache, PaddingObserverMixin):
        raise ValueError(
            f"f: load_cache reads a saved hf_kvcache cache, this file holds a {type(cache).__name__} "
            "(load other objects with torch.load)"
        )
    cache.attach(model)
    return cache
