"""What every hf_kvcache cache shares: reading the model it serves, memory reporting, reset, and the hook that tells a
cache about its forwards."""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

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
from .._version import __version__
from ..layers._common import AttentionMode, PaddingTracker
from ..layers._storage import loaded_device, mapping_devices
from ..rope import rope_fields

__all__ = ["KVCacheReportMixin", "PaddingObserverMixin", "load_cache", "split_model"]


def _difference(built: list[LayerSpec], given: list[LayerSpec]) -> str:
    """The first way ``given`` layers differ from the ``built`` ones, in words."""
    if len(built) != len(given):
        return f"{len(given)} layers where the cache holds {len(built)}"
    i, (a, b) = next((i, pair) for i, pair in enumerate(zip(built, given)) if pair[0] != pair[1])
    fields = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return f"layer {i}'s " + ", ".join(f"{f} is {getattr(b, f)!r} (the cache's {getattr(a, f)!r})" for f in fields)


# The layout of a saved cache: bumped with any change to what a cache, its layers or their storage pickle, so that
# a file of another layout is refused by name (hf_kvcache's release number alone moves less often). The test of the
# saved layout (tests/test_saved_cache.py) records the classes and attributes each number stands for.
SAVED_FORMAT = 3


def _stamp() -> dict[str, object]:
    return {"hf_kvcache": __version__, "transformers": transformers.__version__, "format": SAVED_FORMAT}


def _saved_cache(cls: type, stamp: dict, devices: tuple[str, ...]):
    """Where unpickling a saved cache starts (:meth:`PaddingObserverMixin.__reduce_ex__`), before its state is read:
    the file pickles this package's and transformers' own layer classes, which another release may lay out otherwise
    (a cache read in the wrong layout would answer wrongly, not fail), and holds tensors of ``devices``."""
    if stamp != _stamp():
        saved = ", ".join(f"{k} {v}" for k, v in stamp.items())
        here = ", ".join(f"{k} {v}" for k, v in _stamp().items())
        raise ValueError(
            f"this {cls.__name__} was saved with {saved}; this process runs {here}: a saved cache loads with the "
            "releases it was saved with (prefill and save it again with these)"
        )
    for device in devices:  # every tensor of the file, the buffers' host copies included, goes to one of these
        target = loaded_device(device)
        try:
            torch.empty(0, device=target)
        except (RuntimeError, AssertionError) as err:  # torch built without CUDA asserts
            onto = "" if str(target) == device else f" (map_location sends it to {target})"
            raise ValueError(
                f"this {cls.__name__} was saved from {device}{onto}, which this process cannot reach ({err}); load it "
                "where that device is, or onto another: load_cache(f, model, map_location='cpu' or "
                "{'cuda:0': 'cuda:1'})"
            ) from err
    return cls.__new__(cls)


def _check_map_location(map_location) -> None:
    named = map_location if isinstance(map_location, dict) else {"": map_location}
    try:
        ok = map_location is None or (
            all(isinstance(k, str) for k in named) and all(torch.device(d) is not None for d in named.values())
        )
    except (RuntimeError, TypeError):  # not a device name, or not a name at all
        ok = False
    if not ok:
        raise ValueError(
            "map_location must be None (each tensor back to the device it was saved from), a device ('cpu', "
            f"'cuda:1', a torch.device) or a dict of saved device names to devices; got {map_location!r}"
        )


def _remap_devices(obj, seen: set | None = None) -> None:
    """Points the device records a loaded cache keeps beside its tensors (a layer's ``device``, the per-device block
    tables' keys) where :func:`loaded_device` sends them; the tensors themselves were placed by the load."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, transformers.PretrainedConfig, weakref.ref, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key in list(obj):
            value = obj[key]
            if isinstance(key, torch.device):
                del obj[key]
                key = loaded_device(key)
            obj[key] = loaded_device(value) if isinstance(value, torch.device) else value
            _remap_devices(value, seen)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            if isinstance(value, torch.device):
                obj[i] = loaded_device(value)
            _remap_devices(value, seen)
    elif isinstance(obj, (tuple, set)):
        for value in obj:
            _remap_devices(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
        _remap_devices(vars(obj), seen)


def _tensor_devices(obj, seen: set | None = None):
    """The devices of the tensors held by ``obj`` (through containers and objects' attributes, not modules or
    configs)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, transformers.PretrainedConfig, weakref.ref)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj.device
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensor_devices(value, seen)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _tensor_devices(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _tensor_devices(vars(obj), seen)


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

    @property
    def is_linear(self) -> list[bool]:
        """Layers with recurrent states and no attention, as transformers 5.24 counts them: a layer with both
        (:class:`~hf_kvcache.layers.state.AttentionWithStates`) is an attention layer. 5.23 counted every layer with
        states as linear but its own ``LinearAttentionAndFullAttentionLayer``, so under our caches it found no full
        layer and built Inkling's full-attention mask from its first (sliding) layer's sizes."""
        return [isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)
                for layer in self.layers]  # fmt: skip

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

    def __reduce_ex__(self, protocol):
        # Unpickling starts with _saved_cache, before any of the state below is read: a file of other releases or
        # layout, or from a device this process lacks, is refused by name there, not half read.
        devices = tuple(sorted({str(d) for d in _tensor_devices(self.layers)}))
        return _saved_cache, (type(self), _stamp(), devices), self.__getstate__()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # The model is not part of a saved cache: the loaded one serves the tokens it holds once attach(model) has
        # given it back the model's config (read at every forward) and forwards (each prefill's left padding).
        state["_observed_model"] = None
        state["_needs_model"] = self.__dict__.get("_built_from_model", False)
        return state

    def _observes_forwards(self) -> bool:
        """Whether the cache needs the model's forwards (each prefill's left padding): every cache but a quantized
        one whose layers all encode each token on its own (:attr:`QuantizedLayer.reads_padding`)."""
        return True

    def attach(self, model: torch.nn.Module) -> None:
        """Serve ``model``: what a cache loaded from a file (``torch.load``, ``pickle``: the model is not saved with
        it) needs before its next forward, and what a cache built from a config may be given to read each prefill's
        left padding itself. ``model`` must have the layers the cache was built for (model type, layer types, heads,
        widths) and the same RoPE parameters."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be the torch.nn.Module the cache serves, got {type(model).__name__}")
        config = resolve_config(model)
        specs = layer_specs(config, type(self).__name__, tensor_parallel_size(model), model)
        built_for = f"this {type(self).__name__} was built for model_type {self.attention_mode.model_type!r}"
        if specs != self.layer_specs:
            raise ValueError(
                f"model: {built_for}; {type(model).__name__} (model_type {model_type(config)!r}) has other layers: "
                f"{_difference(self.layer_specs, specs)}. Attach the model the cache was built from"
            )
        saved, given = rope_fields(self.attention_mode.config), rope_fields(config)
        if saved != given:
            differ = {k: (saved[k], given[k]) for k in saved if saved[k] != given[k]}
            raise ValueError(
                f"model: {built_for}, whose keys were rotated with other RoPE parameters than this model's ("
                + "; ".join(f"{k} {a!r} in the cache, {b!r} in the model" for k, (a, b) in differ.items())
                + "). Attach the model the cache was built from"
            )
        self.attention_mode.bind(config, model)
        observed = self.__dict__.get("_observed_model")
        if self._observes_forwards() and (observed is None or observed() is not model):
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
        if not self._needs_model:  # a loaded cache's forward is refused at its first write: nothing changes before
            self.padding.observe(kwargs.get("attention_mask"))


# Every Cache method a forward (or generate's set-up) calls that stores or sizes anything: a loaded cache refuses each
# before it changes a thing (a hybrid model's first layer may update its recurrent states before any attention layer
# asks for the mask sizes, as where a 4-D mask is passed).
_STATE_WRITES = (
    "activate_past_recording",  # assisted decoding, before its first forward
    "update",
    "get_mask_sizes",
    "update_conv_state",
    "update_recurrent_state",
    "update_indexer",
    "early_initialization",
)


def _refusing_until_attached(name: str):
    def method(self, *args, **kwargs):
        self._check_attached()
        return getattr(super(PaddingObserverMixin, self), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in _STATE_WRITES:
    if hasattr(Cache, _name):  # the release's Cache has it (a method transformers lacks stays absent)
        setattr(PaddingObserverMixin, _name, _refusing_until_attached(_name))


def load_cache(f, model: torch.nn.Module, map_location=None):
    """A cache saved with ``torch.save(cache, f)`` (any hf_kvcache cache, prefilled or not), attached to ``model``
    and ready to continue: ``model.generate(..., past_key_values=load_cache(f, model))`` continues as the saved cache
    would have. ``f``: a path or file object, as ``torch.load`` takes. The file is a pickle: load only files you
    trust.

    ``map_location``: where its tensors go. None (default): each back to the device it was saved from. A device
    (``"cpu"``, ``"cuda:1"``, a ``torch.device``): every tensor there, as for a model moved there. A dict of saved
    device names to devices (``{"cuda:0": "cuda:1"}``): a model split over devices, each layer where its model layer
    now is. A cache serves forwards whose keys and values are on its layers' devices.
    """
    _check_map_location(map_location)
    if isinstance(map_location, dict):
        map_location = {k: str(torch.device(v)) for k, v in map_location.items()}
    elif map_location is not None:
        map_location = str(torch.device(map_location))
    with mapping_devices(map_location):
        cache = torch.load(f, weights_only=False, map_location=map_location)
        if isinstance(cache, PaddingObserverMixin) and map_location is not None:
            _remap_devices(cache)
    if not isinstance(cache, PaddingObserverMixin):
        raise ValueError(
            f"f: load_cache reads a saved hf_kvcache cache, this file holds a {type(cache).__name__} "
            "(load other objects with torch.load)"
        )
    cache.attach(model)
    return cache
