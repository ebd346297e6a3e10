"""Vision-language models with images through the caches: the image's tokens enter the cache with the prompt, as
their features (not token embeddings), and Qwen2-VL places them (and the text after them) at multimodal RoPE
positions that are not the cache's token index. Lossless caches reproduce DynamicCache exactly and lossy ones stay
within their bounds under sdpa and the ``hf_kvcache`` attention, on a left-padded batch of two rows with an image
each; the defaults that replay RoPE by token index fall back (int2's pre-RoPE keys) or refuse (the sink window's
re-rotation), and the window that keeps the image's keys where they are runs."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from models import assert_generation_matches, generate
from transformers import (
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from hf_kvcache import make_cache
from hf_kvcache.compare import LOGIT_BOUNDS

VOCAB, PROMPT, NEW = 128, 16, 8
IMAGE, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3  # Qwen2-VL's image, vision-start and vision-end tokens
CASES = {  # spec, lossless, logit bound
    "paged": ("paged:block_size=4", True, 0.0),
    "int8": ("int8", False, LOGIT_BOUNDS["int8"]),
    "int4": ("int4:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int4"]),
    "int2": ("int2:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int2"]),  # rotation, sinks; keys after RoPE
}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _llava():
    """CLIP over 32 x 32 images in 16 x 16 patches: 4 image tokens (the CLS feature dropped)."""
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=16, projection_dim=32)  # fmt: skip
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=LlamaConfig(**TEXT).to_dict(),
                         image_token_index=IMAGE)  # fmt: skip
    return LlavaForConditionalGeneration(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def _qwen2_vl():
    """A 16 x 16 image in 4 x 4 patches, merged 2 x 2: 4 image tokens at 3-D multimodal RoPE positions."""
    config = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, mlp_ratio=2),
        text_config=TEXT | {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VOCAB - 4,
    )  # fmt: skip
    images = {"pixel_values": torch.randn(2 * 16, 3 * 2 * 4 * 4), "image_grid_thw": torch.tensor([[1, 4, 4]] * 2)}
    return Qwen2VLForConditionalGeneration(config), images


FAMILIES = {"llava": _llava, "qwen2_vl": _qwen2_vl}


@cache
def _model(family: str, attn: str):
    """The family's tiny model (seeded: the same weights for every attention) and its prompt: two rows, the second
    left-padded by 2, an image's 4 tokens after the third token of each."""
    torch.manual_seed(0)
    model, images = FAMILIES[family]()
    model = model.eval()
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids = torch.randint(3, VOCAB - 5, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ids[:, 3], ids[:, 4:8], ids[:, 8] = START, IMAGE, END  # LLaVA reads only the image tokens
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return model, {"input_ids": ids, "attention_mask": mask, **images}


@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_prompt_generates_as_with_dynamic_cache(family, name, attn):
    spec, lossless, bound = CASES[name]
    model, inputs = _model(family, attn)
    ref = generate(model, DynamicCache(config=model.config), inputs, NEW)
    out = generate(model, make_cache(spec, model), inputs, NEW)
    assert_generation_matches(out, ref, lossless, bound)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_image_is_read(family):
    """Another image changes what is generated: the prompts above carry the image's features into the cache."""
    model, inputs = _model(family, "sdpa")
    ref = generate(model, DynamicCache(config=model.config), inputs, NEW)
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    other = generate(model, DynamicCache(config=model.config), blank, NEW)
    assert any((a - b).abs().amax() > 1e-3 for a, b in zip(ref.logits, other.logits))


def test_multimodal_positions_are_never_replayed_by_token_index():
    """Keys stored before RoPE and re-rotated sinks would replay RoPE by token index, which Qwen2-VL's image tokens
    (and the text after them) do not follow: asked for, they are refused by name; int2's default falls back to keys
    after RoPE (the cases above); the window that keeps the keys' own rotation (``rerotate=False``) runs."""
    model, inputs = _model("qwen2_vl", "sdpa")
    for spec in ("sink:window=8:sinks=2", "int2:pre_rope=true"):
        with pytest.raises(ValueError, match=r"model_type 'qwen2_vl_text' uses multimodal RoPE \(mrope_section\)"):
            make_cache(spec, model)
    assert make_cache("int2", model).pre_rope is False
    out = generate(model, make_cache("sink:window=8:sinks=2:rerotate=false", model), inputs, NEW)
    assert out.sequences.shape == (2, PROMPT + NEW)
