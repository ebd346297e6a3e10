"""Reading what a cache needs from a model config: layer types, windows, KV heads and head dim."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

# Layer types whose cache is plain K/V (chunked attention behaves like a sliding window for the cache).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class LayerSpec:
    layer_type: str  # one of ATTENTION_LAYER_TYPES
    sliding_window: int | None  # tokens of the model's own window on sliding / chunked layers, else None
    num_kv_heads: int
    head_dim: int


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


def layer_specs(config: PretrainedConfig, cache_name: str) -> list[LayerSpec]:
    """One :class:`LayerSpec` per decoder layer; refuses layer kinds a K/V cache cannot serve."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    unsupported = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"{cache_name} supports models whose layers are {', '.join(ATTENTION_LAYER_TYPES)}; this config has "
            f"{', '.join(unsupported)} layers (linear attention, KV sharing or MoE-only layers are not supported)"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return [
        LayerSpec(t, kw.get("sliding_window") if t != "full_attention" else None, kv_heads, head_dim)
        for t, kw in zip(layer_types, layer_kwargs)
    ]
