"""Rotary position embeddings (RoPE) as a cache sees them: which rotation a model applied to its keys, and how to
move a cached key to another position.

RoPE rotates each channel pair of a key by ``position * inv_freq``; rotations compose, so a key cached at position
``p`` becomes the key of position ``p + delta`` by one more rotation by ``delta * inv_freq``
(``R(delta) R(p) = R(p + delta)``). A constant ``attention_scaling`` (YaRN) is already inside the cached key and is
not applied again. That is how :class:`~hf_kvcache.SlidingWindowKVCache` re-rotates its attention sinks
(StreamingLLM, https://arxiv.org/abs/2309.17453).

The rotation is read from the model's own rotary embedding module (the ``*RotaryEmbedding`` class of its modeling
file), not re-derived from the config, so scaled frequencies (linear, llama3, YaRN, proportional), partial rotary
(only the first ``rotary_dim`` channels rotate) and the two channel layouts (``rotate_half``: channel ``i`` pairs with
``i + rotary_dim / 2``; interleaved: ``2i`` pairs with ``2i + 1``) come out as the model computes them. The module's
output is probed at one position to tell the layout: a ``(cos, sin)`` pair over the rotary channels or over half of
them (GPT-OSS), or complex ``freqs_cis`` (pairs ``2i, 2i + 1``). GPT-J and CodeGen have no such module; their
attention layers hold a sinusoidal ``embed_positions`` table (``[sin | cos]``, interleaved pairs), read the same way.
Frequencies that change with the sequence length (``dynamic``, ``longrope``) and multimodal RoPE cannot be re-rotated
exactly and are refused; so is a model whose config speaks of rotary embeddings that this module cannot find.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass

import torch

from ._config import INDEXED_LAYER_TYPES, WITH_STATES_LAYER_TYPES

__all__ = ["RotarySpec", "rerotate", "rotary_spec", "rotate_positions"]

_LENGTH_DEPENDENT = ("dynamic", "longrope")
# Families whose attention layers rotate keys with a sinusoidal ``embed_positions`` table (base 10000, interleaved).
_SINUSOIDAL_TABLE_MODELS = ("gptj", "codegen")
# Config fields that mean "this model rotates its keys".
_ROPE_HINTS = ("rotary_dim", "rope_theta", "rope_parameters", "rotary_pct", "partial_rotary_factor", "rotary_emb_base")


def rope_fields(config) -> dict:
    """The config's RoPE parameters, by field (None where unset): two configs whose fields differ rotate keys
    differently, though their layers have the same shapes."""
    return {name: getattr(config, name, None) for name in (*_ROPE_HINTS, "rope_scaling")}


def declines_rope(config) -> bool:
    """Whether a config that carries RoPE parameters turns RoPE off with a flag its modeling code reads: Granite 4's
    hybrids build no rotary embedding unless ``position_embedding_type == "rope"`` (None and "nope" are NoPE),
    Zamba2 none unless ``use_mem_rope``."""
    if "position_embedding_type" in vars(config) and config.position_embedding_type in (None, "nope"):
        return True
    return getattr(config, "use_mem_rope", None) is False


@dataclass(frozen=True)
class RotarySpec:
    """The rotation a model applies to its keys on one layer type."""

    inv_freq: torch.Tensor  # (rotary_dim / 2,) float32 angular frequency per channel pair
    rotary_dim: int  # leading channels that rotate; the rest pass through (partial rotary)
    interleaved: bool  # channel pairs (2i, 2i + 1) instead of (i, i + rotary_dim / 2)


def rerotate(x: torch.Tensor, delta: torch.Tensor | int, spec: RotarySpec) -> torch.Tensor:
    """Rotate keys ``x`` ``(B, H, T, D)`` by ``delta`` positions (an int or one per batch row, ``(B,)``).

    Angles are computed in float32, as transformers computes them, and the result has ``x``'s dtype.
    """
    b = x.shape[0]
    delta = torch.as_tensor(delta, device=x.device).reshape(-1).expand(b) if not isinstance(delta, int) else delta
    inv_freq = spec.inv_freq.to(x.device)
    if isinstance(delta, int):
        angles = (delta * inv_freq).view(1, 1, 1, -1)
    else:
        angles = delta.float().view(b, 1, 1, 1) * inv_freq.view(1, 1, 1, -1)  # (B, 1, 1, R/2)
    return _turn(x, angles.cos(), angles.sin(), spec)


def rotate_positions(x: torch.Tensor, first: int, spec: RotarySpec, inverse: bool = False) -> torch.Tensor:
    """Rotate keys ``x`` ``(B, H, T, D)`` as RoPE rotates token ``t`` at position ``first + t`` (``inverse``: by minus
    that, back to the key before RoPE). The forward and the inverse use the same float32 angles (``position *
    inv_freq``), so one undoes the other to float rounding (what pre-RoPE quantization relies on); their cosines and
    sines come from a table kept per rotation and device (:class:`_AngleTable`), so reading ``T`` stored keys costs
    the turn itself, not ``T x R`` trigonometric functions every step."""
    cos, sin = _ANGLES.get(spec, first, first + x.shape[-2], x.device)  # (T, R/2)
    return _turn(x, cos, -sin if inverse else sin, spec)


class _AngleTable:
    """``cos`` and ``sin`` of ``position * inv_freq`` (float32) for positions ``0 .. n``, per rotation and device, as
    one ``(n, 2, R/2)`` tensor (the Triton kernel reads it in place, :func:`angle_table`), grown geometrically as
    longer sequences come; a few rotations kept (the models of a process). A rotation is known by its ``inv_freq``
    tensor, held weakly: the table never keeps a cache's tensors alive."""

    KEEP = 8

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}

    def table(self, inv_freq: torch.Tensor, stop: int, device: torch.device) -> torch.Tensor:
        key = (id(inv_freq), torch.device(device))
        entry = self._tables.get(key)
        same = entry is not None and entry[0]() is inv_freq
        if not same or entry[1].shape[0] < stop:
            size = max(stop, 2 * entry[1].shape[0] if same else 0, 1024)
            positions = torch.arange(size, device=device, dtype=torch.float32)
            angles = positions[:, None] * inv_freq.to(device)[None, :]  # (n, R/2), as transformers computes
            self._tables.pop(key, None)
            if len(self._tables) >= self.KEEP:
                self._tables.pop(next(iter(self._tables)))
            entry = self._tables[key] = (weakref.ref(inv_freq), torch.stack([angles.cos(), angles.sin()], 1))
        return entry[1]

    def get(self, spec: RotarySpec, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table(spec.inv_freq, stop, device)
        return table[start:stop, 0], table[start:stop, 1]


_ANGLES = _AngleTable()


def angle_table(inv_freq: torch.Tensor, stop: int) -> torch.Tensor:
    """``(n, 2, R/2)`` float32, ``n >= stop``: row ``p`` holds ``cos`` then ``sin`` of ``p * inv_freq`` (the angles
    :func:`rotate_positions` turns keys by), on ``inv_freq``'s device; built once per rotation and reused."""
    return _ANGLES.table(inv_freq, stop, inv_freq.device)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """``x`` with every rotary channel pair turned by the angles whose ``cos`` / ``sin`` are given per pair
    (broadcast to ``(B, H, T, R/2)``): ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``."""
    r = spec.rotary_dim
    rot, rest = x[..., :r].float(), x[..., r:]
    if spec.interleaved:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if spec.interleaved:
        out = torch.stack([first, second], dim=-1).flatten(-2).to(x.dtype)
    else:
        out = torch.cat([first, second], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _rotary_module(model_or_config, config, way_out: str = "rerotate=False"):
    """The model's rotary embedding module: found in the model, or built from its modeling file. None if absent."""
    if isinstance(model_or_config, torch.nn.Module):
        for module in model_or_config.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                return module
        return None
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) or MODEL_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(
            f"cannot find the modeling code of model_type {config.model_type!r} to read its rotary embedding; "
            f"pass the model instead of its config, or use {way_out}"
        )
    modeling = sys.modules[getattr(transformers, name).__module__]
    classes = [
        obj
        for obj in vars(modeling).values()
        if isinstance(obj, type)
        and issubclass(obj, torch.nn.Module)
        and obj.__name__.endswith("RotaryEmbedding")
        and "vision" not in obj.__name__.lower()
    ]
    if not classes:
        return None
    return classes[0](config=config)


def _table_spec(model_or_config, config, way_out: str = "rerotate=False") -> RotarySpec | None:
    """GPT-J / CodeGen: inverse frequencies read off the model's ``embed_positions`` table, or from the config."""
    if getattr(config, "model_type", None) not in _SINUSOIDAL_TABLE_MODELS:
        return None
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_dim = getattr(config, "rotary_dim", None) or head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))
    if isinstance(model_or_config, torch.nn.Module):
        tables = [
            m.embed_positions
            for m in model_or_config.modules()
            if isinstance(getattr(m, "embed_positions", None), torch.Tensor)
        ]
        if tables:
            table = tables[0].detach().float().cpu()  # (positions, rotary_dim): [sin | cos]
            half = table.shape[-1] // 2
            read = torch.atan2(table[1, :half], table[1, half:])  # the angle at position 1 is inv_freq
            if table.shape[-1] != rotary_dim or not torch.allclose(read, inv_freq.float(), atol=1e-6):
                raise ValueError(
                    f"the embed_positions table of this {config.model_type} model does not match base-10000 rotary "
                    f"frequencies, so its keys cannot be re-rotated safely; use {way_out}"
                )
    return RotarySpec(inv_freq=inv_freq.float(), rotary_dim=rotary_dim, interleaved=True)


def _probe_layout(module, inv_freq: torch.Tensor, scaling: float, layer_type: str) -> RotarySpec | None:
    """Read the module's output at one position and match it against the two channel layouts."""
    position = 3
    device = inv_freq.device
    kwargs = {"layer_type": layer_type} if "layer_type" in inspect.signature(module.forward).parameters else {}
    probe = torch.zeros(1, 1, 2 * inv_freq.numel(), device=device)
    with torch.no_grad():
        out = module.forward(probe, torch.tensor([[position]], device=device), **kwargs)
    inv_freq = inv_freq.detach().float().cpu()
    base = torch.cos(position * inv_freq) * scaling
    if isinstance(out, torch.Tensor) and out.is_complex():  # freqs_cis: view_as_complex over pairs (2i, 2i + 1)
        cos = out.real.float().reshape(-1).cpu()
        if cos.numel() == base.numel() and torch.allclose(cos, base, atol=1e-5, rtol=1e-5):
            return RotarySpec(inv_freq=inv_freq, rotary_dim=2 * cos.numel(), interleaved=True)
        return None
    cos = out[0].float().reshape(-1).cpu()
    if cos.numel() == base.numel() and torch.allclose(cos, base, atol=1e-5, rtol=1e-5):
        # A table over half the rotary channels, applied to the two halves (GPT-OSS): the rotate_half layout.
        return RotarySpec(inv_freq=inv_freq, rotary_dim=2 * cos.numel(), interleaved=False)
    for interleaved, expected in ((False, torch.cat([base, base])), (True, base.repeat_interleave(2))):
        if cos.numel() == expected.numel() and torch.allclose(cos, expected, atol=1e-5, rtol=1e-5):
            return RotarySpec(inv_freq=inv_freq, rotary_dim=cos.numel(), interleaved=interleaved)
    return None


def _scaled(value, layer_type: str):
    return value[layer_type] if isinstance(value, dict) else value


def _model_kind(config, layer_type: str) -> str:
    """The model's own name for the layers the caches serve as ``layer_type``, which keys its per-kind RoPE
    (ZAYA's attention layers, which hold states too, are ``"hybrid"``; sparse attention's ``"indexed_attention"``)."""
    served_as = INDEXED_LAYER_TYPES | WITH_STATES_LAYER_TYPES
    kinds = getattr(config, "layer_types", None) or ()
    if layer_type in kinds:
        return layer_type
    return next((kind for kind in kinds if served_as.get(kind) == layer_type), layer_type)


def rotary_spec(
    model_or_config, config, layer_type: str = "full_attention", way_out: str = "rerotate=False"
) -> RotarySpec | None:
    """:class:`RotarySpec` of ``layer_type`` layers, or None when the model has no rotary embedding. ``way_out``:
    the option a refusal tells the user to turn off.

    Raises:
        ValueError: the rotation depends on the sequence length (``dynamic``, ``longrope``), is multimodal, or has a
            layout this function cannot verify.
    """
    layer_type = _model_kind(config, layer_type)
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope_parameters, dict) and layer_type in rope_parameters:
        rope_parameters = rope_parameters[layer_type]
        if rope_parameters is None:
            return None  # per-layer-kind parameters, none for this kind: its layers are NoPE (Beam's full layers)
    # Multimodal RoPE named by the config, or the module's own default sections where it names none (Qwen2-VL /
    # 2.5-VL / 3-VL, Qwen3.5, GLM-4V)
    mrope = isinstance(rope_parameters, dict) and "mrope_section" in rope_parameters
    module = None if mrope else _rotary_module(model_or_config, config, way_out)
    if mrope or getattr(module, "mrope_section", None) is not None:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r} uses multimodal RoPE (mrope_section): the positions of "
            f"image tokens, and of the text after them, are not the cache's token index, so its keys cannot be "
            f"re-rotated; use {way_out}"
        )
    if module is None and declines_rope(config):
        return None
    # GPT-J / CodeGen rotate by a sinusoidal table: in their attention modules before transformers 5.24, in a
    # rotary module with no inverse frequencies since
    if module is None or getattr(config, "model_type", None) in _SINUSOIDAL_TABLE_MODELS:
        spec = _table_spec(model_or_config, config, way_out)
        if spec is None and any(getattr(config, hint, None) for hint in _ROPE_HINTS):
            hints = [hint for hint in _ROPE_HINTS if getattr(config, hint, None)]
            raise ValueError(
                f"model_type {getattr(config, 'model_type', '?')!r} looks like it rotates its keys (its config has "
                f"{', '.join(hints)}), but hf_kvcache cannot find its rotary embedding to re-rotate its keys; use "
                f"{way_out}"
            )
        return spec
    rope_type = _scaled(getattr(module, "rope_type", "default"), layer_type)
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r}: its rope_type {rope_type!r} changes its frequencies "
            f"with the sequence length, so cached keys cannot be re-rotated exactly; use {way_out}"
        )
    inv_freq = getattr(module, f"{layer_type}_inv_freq", None)
    if inv_freq is None:
        inv_freq = module.inv_freq
    scaling = float(_scaled(getattr(module, "attention_scaling", 1.0), layer_type))
    spec = _probe_layout(module, inv_freq, scaling, layer_type)
    if spec is not None:
        return spec
    raise ValueError(
        f"{type(module).__name__} produces a rotation that matches neither the rotate_half nor the interleaved "
        f"layout, so its keys cannot be re-rotated safely; use {way_out}"
    )
