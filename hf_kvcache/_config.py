"""Reading what a cache needs from a model config: layer types, windows, KV heads, key and value widths, RoPE.

One :class:`LayerSpec` per decoder layer describes what the model will pass to ``Cache.update`` on that layer. Most
models pass keys and values of one width (``head_dim``); multi-head latent attention (DeepSeek-V2/V3 and their
descendants) caches its compressed latents instead: one "head" whose key slot is the ``kv_lora_rank``-wide latent and
whose value slot is the ``qk_rope_head_dim``-wide rotated key, so keys and values differ in width there. Where that
rotated key has no channels (GLM-5-Next's NoPE latent layers), the spec describes how the cache stores the latent:
half in the key slot, half in the value slot (``split_keys``), so no format ever holds an empty tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "INDEXED_LAYER_TYPES",
    "STATE_LAYER_TYPES",
    "WITH_STATES_LAYER_TYPES",
    "LayerSpec",
    "has_indexed_layers",
    "has_state_layers",
    "is_latent_attention",
    "decoder_layer",
    "decoder_layers",
    "layer_specs",
    "layers_read_in_place",
    "loop_layers",
    "model_type",
    "recurrent_loops",
    "resolve_config",
    "tensor_parallel_size",
    "uses_alibi",
]

# Layer types whose cache is plain K/V (chunked attention behaves like a sliding window for the cache).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Layers of hybrid models that keep no per-token K/V: fixed-size convolution / recurrent states (Mamba, gated
# DeltaNet, LFM2's convolutions; "linear_attention", "conv") and layers with nothing to cache (MoE- or MLP-only
# blocks, which transformers calls "dummy"). Every cache keeps them as transformers does (``hf_kvcache.layers.state``).
STATE_LAYER_TYPES = ("linear_attention", "conv", "dummy")
# Layers with recurrent states *and* attention (Falcon-H1, Zamba: full; Inkling: a sliding window beside its short
# convolutions' states): the attention's kind of cache beside the states.
WITH_STATES_LAYER_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# DeepSeek-V4's compressed attention: a sliding window beside compressed entries (one per 4 or 128 tokens) that the
# model writes and reads through its own cache layer classes' methods; refused by name.
COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
# Layers of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5's glm_moe_dsa): full attention whose indexer keeps one
# narrow key per token beside the K/V (``Cache.update_indexer``) to pick each query's top-k tokens.
INDEXED_LAYER_TYPES = {"indexed_attention": "full_attention"}


@dataclass(frozen=True)
class LayerSpec:
    layer_type: str  # one of ATTENTION_LAYER_TYPES
    sliding_window: int | None  # tokens of the model's own window on sliding / chunked layers, else None
    num_kv_heads: int  # heads of the key_states / value_states the model passes to the cache
    key_dim: int  # channels per head of key_states
    value_dim: int  # channels per head of value_states (differs from key_dim under latent attention)
    uses_rope: bool = True  # False on the NoPE layers of SmolLM3 and Llama 4 (``no_rope_layers``)
    # recurrent / convolution states of a STATE_LAYER_TYPES layer, or of an attention layer that has both
    # (WITH_STATES_LAYER_TYPES; its layer_type is then its attention's): transformers' number_of_states
    states: int = 0
    # channels of the indexer key an INDEXED_LAYER_TYPES layer keeps per token (its layer_type is then its
    # attention's), 0 for the others
    indexer_dim: int = 0
    # The model passes its keys with key_dim + value_dim channels and values with none (NoPE latent attention:
    # GLM-5-Next); the cache stores the keys' first key_dim channels in its key slot and the rest in its value slot
    # (layers.inside.SplitKeys) and hands the keys back whole, beside an empty value.
    split_keys: bool = False
    # A recurrent-depth model's loop copy (loop_layers): the decoder layer this cache layer serves once more, whose
    # options (key widths, boundary layers) it takes; None for a decoder layer's own cache layer.
    source: int | None = None

    @property
    def passed_key_dim(self) -> int:
        """Channels per head of the key_states the model passes (the whole latent where it is split over both slots)."""
        return self.key_dim + self.value_dim if self.split_keys else self.key_dim

    @property
    def holds_kv(self) -> bool:
        """Whether the model passes this layer's keys and values to the cache (else: a state layer, no K/V)."""
        return self.layer_type in ATTENTION_LAYER_TYPES

    @property
    def bytes_per_token_factor(self) -> int:
        """Elements stored per token of this layer (keys and values, all heads; not an indexer's key)."""
        return self.num_kv_heads * (self.key_dim + self.value_dim)


def has_state_layers(config: PretrainedConfig) -> bool:
    """Whether ``config`` has recurrent / convolution states or MLP-only blocks beside (or with) its attention."""
    return any(t in STATE_LAYER_TYPES or t in WITH_STATES_LAYER_TYPES for t in get_layer_types_and_kwargs(config)[0])


def _indexer_width(config: PretrainedConfig) -> int | None:
    """Channels of the indexer key an ``indexed_attention`` layer caches per token: ``index_head_dim`` (DeepSeek-V3.2,
    GLM-5, AXK2, HY-V4), or ``indexer_head_dim`` times ``indexer_kv_heads`` (Qwen4-Exp's QSA indexer, which keeps
    one head of them). GLM-5-Next's pooled indexer (``index_kpool``) caches each key packed with its pool gate (as
    wide) and a validity channel: ``2 * index_head_dim + 1``. None where the config names neither."""
    width = _global(config, "index_head_dim")
    if isinstance(width, int) and isinstance(_global(config, "index_kpool"), int):
        return 2 * width + 1
    if width is None:
        width, heads = _global(config, "indexer_head_dim"), _global(config, "indexer_kv_heads") or 1
        width = width * heads if isinstance(width, int) and isinstance(heads, int) else None
    return width


def has_indexed_layers(config: PretrainedConfig) -> bool:
    """Whether ``config`` has sparse-attention layers whose indexer keeps keys beside the K/V (DeepSeek-V3.2)."""
    return any(t in INDEXED_LAYER_TYPES for t in get_layer_types_and_kwargs(config)[0])


def resolve_config(config) -> PretrainedConfig:
    """The decoder text config of a ``PretrainedConfig`` or of a model that carries one."""
    if not isinstance(config, PretrainedConfig):
        inner = getattr(config, "config", None)
        if not isinstance(inner, PretrainedConfig):
            raise ValueError(
                f"config must be a transformers PretrainedConfig or a PreTrainedModel, got {type(config).__name__}"
            )
        config = inner
    return config.get_text_config(decoder=True)


def model_type(config: PretrainedConfig) -> str:
    return getattr(config, "model_type", None) or type(config).__name__


def _global(config, name: str):
    """A config attribute, or None where it is unset or per-layer (transformers' heterogeneous configs raise on a
    global read of an attribute that varies across layers)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001  (AmbiguousGlobalPerLayerAttributeError is not an AttributeError)
        return None


def recurrent_loops(config: PretrainedConfig) -> int:
    """How many times a recurrent-depth model runs its recurrent section in a forward (Dory's ``n_recurrent_loops``);
    1 for every other model."""
    loops = _global(config, "n_recurrent_loops")
    return loops if isinstance(loops, int) and loops > 1 else 1


def _recurrent_section(config: PretrainedConfig, mode: str) -> list[int]:
    """The decoder layers a recurrent-depth model loops over, where it keeps its cache in ``mode``; else ``[]``."""
    if recurrent_loops(config) == 1 or _global(config, "recurrent_kv_cache_mode") != mode:
        return []
    return list(range(config.n_input_layers, config.n_input_layers + config.n_recurrent_layers))


def loop_layers(config: PretrainedConfig) -> list[int]:
    """The decoder layers a recurrent-depth model caches once more per loop after the first, in the order it appends
    their copies to ``cache.layers`` at its first forward (Dory with ``recurrent_kv_cache_mode="per_loop"``, its
    default: each pass through the recurrent section writes to its own cache layers); ``[]`` for every other model.
    Every cache builds those layers up front (:func:`layer_specs`), so the model finds them and appends none."""
    return _recurrent_section(config, "per_loop") * (recurrent_loops(config) - 1)


def layers_read_in_place(config: PretrainedConfig) -> list[int]:
    """Decoder layers whose stored keys and values the model reads as tensors (``cache.layers[i].keys`` / ``.values``)
    besides calling ``update``: Dory with ``recurrent_kv_cache_mode="last_loop"`` keeps one cache layer for all its
    loops, written by the last, and has the earlier loops read the recurrent section's past from it that way."""
    return _recurrent_section(config, "last_loop")


def decoder_layer(specs: list[LayerSpec], index: int) -> int:
    """The decoder layer cache layer ``index`` serves: itself, or a loop layer's ``source``."""
    source = specs[index].source
    return index if source is None else source


def decoder_layers(specs: list[LayerSpec]) -> int:
    """How many of :func:`layer_specs`' specs are the model's own decoder layers (they come first, a recurrent-depth
    model's loop layers after them): the layers per-layer options (``key_bits``, ``boundary_layers``) name."""
    return sum(s.source is None for s in specs)


def _latent_layer(layer_config) -> bool:
    return isinstance(_global(layer_config, "kv_lora_rank"), int) and isinstance(
        _global(layer_config, "qk_rope_head_dim"), int
    )


def is_latent_attention(config: PretrainedConfig) -> bool:
    """Multi-head latent attention: the model caches a compressed latent and a shared rotated key, not K/V. A config
    whose widths vary by layer (transformers' ``per_layer_config``: Dots 3 Note's sliding layers have a latent twice
    as wide) is latent where any layer is."""
    if _latent_layer(config):
        return True
    layers = _global(config, "per_layer_config")
    return layers is not None and any(_latent_layer(layer) for layer in layers)


def uses_alibi(config: PretrainedConfig) -> bool:
    """ALiBi position biases (BLOOM, MPT, Falcon with ``alibi=True``), which models build from the full mask."""
    attn_config = getattr(config, "attn_config", None)
    return (
        model_type(config) == "bloom"
        or getattr(config, "alibi", False) is True
        or getattr(attn_config, "alibi", False) is True
        or getattr(config, "position_embedding_type", None) == "alibi"
    )


def _rope_flags(config: PretrainedConfig, n_layers: int) -> list[bool]:
    """Per layer, whether it applies RoPE. ``no_rope_layers`` (SmolLM3, Llama 4) holds 1 where a layer *uses* RoPE,
    as their modeling code reads it (``self.use_rope = config.no_rope_layers[layer_idx]``)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        return [True] * n_layers
    return [bool(f) for f in flags]


class _SlidingWidths:
    """A layer config read as its sliding layers see it: ``swa_num_attention_heads``, ``swa_num_key_value_heads`` and
    ``swa_head_dim`` (Inkling's) over the global widths, where the config names them."""

    _NAMES = ("num_attention_heads", "num_key_value_heads", "head_dim")

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        if name in self._NAMES:
            own = _global(self._config, f"swa_{name}")
            if isinstance(own, int) and own > 0:
                return own
        return getattr(self._config, name)


def _cached_kv_heads(config: PretrainedConfig, layer_config, q_heads: int) -> int:
    """KV heads a layer passes to the cache, where the config's attribute names do not say it directly."""
    if model_type(config) == "falcon":
        # Falcon's modeling code: the new decoder architecture expands its num_kv_heads to every query head before
        # caching; multi_query (falcon-7b) caches one head; otherwise num_kv_heads (default: every query head).
        if config.new_decoder_architecture:
            return q_heads
        return 1 if config.multi_query else (config.num_kv_heads or q_heads)
    if model_type(config) == "gpt_bigcode":
        # Its modeling code reads multi_query (StarCoder, SantaCoder: one cached head), not num_key_value_heads, which
        # a config keeps from its construction even when multi_query is set afterwards.
        return 1 if config.multi_query else q_heads
    return getattr(layer_config, "num_key_value_heads", None) or q_heads


def tensor_parallel_size(model) -> int:
    """How many ranks share each layer's heads: transformers' ``tp_size`` of a model loaded with ``tp_plan``, else 1."""
    size = getattr(model, "tp_size", None) if not isinstance(model, PretrainedConfig) else None
    return size if isinstance(size, int) and size > 1 else 1


def _module_layouts(model) -> dict[int, tuple[int, int, int]]:
    """``{layer_idx: (kv heads, key width, value width)}`` read from the model's self-attention modules that project
    keys and values with ``k_proj`` / ``v_proj`` and name their ``head_dim``: what the layers really pass, where a
    modeling file departs from its config (MiMo-V2-Flash doubles the KV heads of its sliding layers). Layers with
    no such module, or with more than one reading, are left to the config."""
    found: dict[int, set] = {}
    for name, module in model.named_modules():
        idx, head_dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if not (isinstance(idx, int) and isinstance(head_dim, int) and head_dim > 0):
            continue
        if not (isinstance(k, torch.nn.Linear) and isinstance(v, torch.nn.Linear)) or "cross" in name.lower():
            continue
        heads = k.out_features // head_dim
        if heads and k.out_features == heads * head_dim and v.out_features % heads == 0:
            found.setdefault(idx, set()).add((heads, head_dim, v.out_features // heads))
    return {i: next(iter(layouts)) for i, layouts in found.items() if len(layouts) == 1}


def layer_specs(config: PretrainedConfig, cache_name: str, tp_size: int = 1, model=None) -> list[LayerSpec]:
    """One :class:`LayerSpec` per decoder layer; refuses layer kinds a K/V cache cannot serve. ``tp_size``: under
    tensor parallelism each rank's layers pass ``1 / tp_size`` of the KV heads (transformers shards them evenly).
    ``model``: where its attention modules show other widths than the config (see :func:`_module_layouts`), the
    modules win."""
    layouts = _module_layouts(model) if isinstance(model, torch.nn.Module) and tp_size == 1 else {}
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if "reuse" in (_global(config, "kv_sharing_modes") or ()):
        raise ValueError(
            f"{cache_name} cannot serve model_type {model_type(config)!r}: some of its layers read another layer's "
            "cached keys and values (KV sharing), which hf_kvcache caches do not hand between layers"
        )
    served = (*ATTENTION_LAYER_TYPES, *INDEXED_LAYER_TYPES, *STATE_LAYER_TYPES, *WITH_STATES_LAYER_TYPES)
    unsupported = sorted({t for t in layer_types if t not in served})
    compressed = [t for t in unsupported if t in COMPRESSED_LAYER_TYPES]
    if compressed:
        raise ValueError(
            f"{cache_name} cannot serve model_type {model_type(config)!r}: its {', '.join(compressed)} layers keep "
            "compressed entries beside a sliding window, which the model builds and reads through transformers' own "
            "layer classes (store_compression_weights, update_compressor_states), not through a cache's update; use "
            "DynamicCache"
        )
    if unsupported:
        attention = ", ".join((*ATTENTION_LAYER_TYPES, *INDEXED_LAYER_TYPES))
        raise ValueError(
            f"{cache_name} supports models whose layers are {attention} (beside "
            f"{', '.join(STATE_LAYER_TYPES + tuple(WITH_STATES_LAYER_TYPES))} layers, whose states are kept as "
            f"transformers keeps them); this config (model_type "
            f"{model_type(config)!r}) has {', '.join(unsupported)} layers"
        )
    if not any(t in ATTENTION_LAYER_TYPES or t in WITH_STATES_LAYER_TYPES or t in INDEXED_LAYER_TYPES
               for t in layer_types):  # fmt: skip
        raise ValueError(
            f"{cache_name} cannot serve model_type {model_type(config)!r}: none of its layers caches keys and values "
            f"(its layers are {', '.join(sorted(set(layer_types)))})"
        )
    if _global(config, "cross_attention_layers"):
        raise ValueError(
            f"{cache_name} cannot serve model_type {model_type(config)!r}: it has cross-attention layers (states "
            "of another modality, kept beside the self-attention cache), which hf_kvcache caches do not hold"
        )
    rope = _rope_flags(config, len(layer_types))
    specs = []
    for i, (kind, kwargs, layer_config) in enumerate(zip(layer_types, layer_kwargs, config.per_layer_config)):
        if kind in STATE_LAYER_TYPES:
            specs.append(LayerSpec(kind, None, 0, 0, 0, False, kwargs.get("number_of_states", 0)))
            continue
        states = kwargs.get("number_of_states", 1) if kind in WITH_STATES_LAYER_TYPES else 0
        indexer = 0
        if kind in INDEXED_LAYER_TYPES:
            indexer = _indexer_width(config)
            if not isinstance(indexer, int) or indexer < 1:
                raise ValueError(
                    f"{cache_name} cannot serve model_type {model_type(config)!r}: its {kind} layers name no "
                    "index_head_dim / indexer_head_dim (the width of the indexer keys they cache)"
                )
        kind = INDEXED_LAYER_TYPES.get(kind, WITH_STATES_LAYER_TYPES.get(kind, kind))
        split = False
        if _latent_layer(layer_config):
            heads, key_dim, value_dim = 1, layer_config.kv_lora_rank, layer_config.qk_rope_head_dim
            if value_dim == 0 and key_dim > 1:  # NoPE latent: nothing in the value slot, the latent split over both
                key_dim, value_dim, split = key_dim - key_dim // 2, key_dim // 2, True
        else:
            if kind == "sliding_attention":  # Inkling's sliding layers have their own widths (swa_*), beside the rest's
                layer_config = _SlidingWidths(layer_config)
            q_heads = _global(layer_config, "num_attention_heads")
            if not isinstance(q_heads, int):
                raise ValueError(
                    f"{cache_name} cannot serve model_type {model_type(config)!r}: its config names no attention "
                    f"heads for layer {i} (a recurrent or state-space model keeps no KV cache)"
                )
            heads = _cached_kv_heads(config, layer_config, q_heads)
            key_dim = value_dim = (
                _global(layer_config, "head_dim") or _global(layer_config, "dim_head")  # dim_head: CPM-Ant
            ) or layer_config.hidden_size // q_heads
            if tp_size > 1:
                if heads % tp_size:
                    raise ValueError(
                        f"{cache_name}: a tensor-parallel degree of {tp_size} does not divide this "
                        f"{model_type(config)} config's {heads} KV heads"
                    )
                heads //= tp_size
            heads, key_dim, value_dim = layouts.get(i, (heads, key_dim, value_dim))
        window = kwargs.get("sliding_window") if kind != "full_attention" else None
        specs.append(LayerSpec(kind, window, heads, key_dim, value_dim, rope[i], states, indexer, split))
    return specs + [replace(specs[i], source=i) for i in loop_layers(config)]
