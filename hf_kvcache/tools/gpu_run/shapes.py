"""The shapes the GPU run measures at: Llama-3-8B's attention (and, with fewer layers where time demands, its whole
architecture), or tiny stand-ins for the smoke run."""

from __future__ import annotations

from transformers import LlamaConfig

from ...compare import LLAMA3_8B

__all__ = ["SMOKE_MODEL", "cache_kinds", "model_config"]

# A tiny Llama with the 8B's proportions where they matter to the kernels (GQA 4:1, RoPE), for --smoke.
SMOKE_MODEL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=4096,
)

# label -> make_cache spec of every kind the run measures, as a user gets it (int4 / int3 / int2: their defaults,
# Hadamard-rotated codes, 4 sinks and 8-bit scales; int3's and int2's keys quantized before RoPE, int2's smoothed).
# "int4 KIVI layout" prices int4's rotation and sinks (KIVI's layout, int4's default before the rotation), "int2 KIVI
# layout" int2's defaults, "int2 unsmoothed" the smoothed keys' one more launch per layer (the query times the
# scales), "int2 16-bit scales" its 8-bit scales (a shift and a product per scale in the decode kernel), "int2 int8
# residual" the rotated int8 residual option (read by the int8 kernel, encoded with its rotation in one launch).
CACHE_KINDS = {
    "int8": "int8",
    "int4": "int4",
    "int3": "int3",
    "int2": "int2",
    "paged": "paged",
    "paged int8": "paged:bits=8",
    "int2 KIVI layout": "int2:rotate=none:sinks=0:pre_rope=false",
    "int4 KIVI layout": "int4:rotate=none:sinks=0",
    "int2 unsmoothed": "int2:smooth=0",
    "int2 16-bit scales": "int2:scale_dtype=none",
    "int2 int8 residual": "int2:residual_bits=8",
    "fp8": "fp8",  # late: measured when the budget allows (its e4m3 bits are only ever read in bfloat16 on a GPU)
    "int2 k4": "int2:key_bits=4",  # 4-bit keys beside 2-bit values: int3's bytes, each tile read at two widths
    "int2 lloyd": "int2:codebook=lloyd",  # Lloyd-Max levels: int2's bytes, each code's level read from a table
}


def cache_kinds() -> dict[str, str]:
    return dict(CACHE_KINDS)


def model_config(smoke: bool, layers: int | None = None) -> LlamaConfig:
    """Llama-3-8B's architecture (``layers`` decoder layers, default all 32), or the smoke model."""
    kwargs = dict(SMOKE_MODEL if smoke else LLAMA3_8B)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config = LlamaConfig(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return config
