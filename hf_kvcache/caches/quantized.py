"""``QuantizedKVCache``: int8, fp8, and KIVI 4/3/2-bit keys and values, for any ``generate()`` mode; registers the
``int8``, ``fp8``, ``int4``, ``int3`` and ``int2`` cache kinds."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .. import quant
from .._config import LayerSpec, decoder_layer, decoder_layers, is_latent_attention
from .._validate import check_choice, check_int, dtype_from_name
from ..calibrate import auto_key_bits
from ..formats import KEY_AXES, ROTATIONS, codec_for
from ..layer_widths import LayerKeyWidths, resolve_key_bits
from ..layers._storage import Workspace
from ..layers.quantized import QuantizedLayer, QuantizedSlidingWindowLayer
from ..layers.state import cache_layer
from ..registry import register_cache
from ..rope import RotarySpec, rotary_spec
from ._base import KVCacheReportMixin, PaddingObserverMixin, split_model

__all__ = ["MEASURED_DEFAULTS", "QuantizedKVCache"]

_BACKENDS = ("torch", "bitsandbytes")
_DEFAULT_RESIDUAL = {8: 0, 4: 128, 3: 128, 2: 128}
AUTO = "auto"
E5M3_NAME = "e5m3"  # scale_dtype's 8-bit scales (quant.E5M3)
_SCALE_DTYPES = ("float32", "float16", "bfloat16")
_KIVI_SCALES = (*_SCALE_DTYPES, E5M3_NAME)  # the names a 4/3/2-bit kind's error lists (e5m3 handled before)
MAX_SMOOTH = 2.0  # the strength of the smoothed keys' scales: past 1 they over-correct (docs/results.md)
# What rotate / sinks / pre_rope = "auto" (the defaults) mean at each width: the best setting measured on SmolLM2
# through the harness, on perplexity (docs/results/eval-ablation.json; tests/test_quantized_cache.py checks the
# defaults against it) and on retrieval. 2 bits: KIVI +32.9%, all three options +2.5%; 3 bits: +2.8% -> +0.1%. At 4
# bits every setting is within 0.25% on perplexity, but not on RULER's four needle tasks (1k tokens, 400 documents,
# docs/results/report-ruler-int4.json): KIVI's layout loses 2.9 points [-5.6, -0.3], and so do 4 sinks alone, where
# every rotated layout keeps DynamicCache's score (rotation alone -0.4; with sinks and 8-bit scales +0.6 [-1.9, +3.0];
# with pre-RoPE keys too +0.3). So int4 rotates, with 4 sinks and 8-bit scales (the fewest bytes of them: 0.97x of
# KIVI's layout's with float32 K/V), its keys after RoPE (pre-RoPE keys bought nothing measurable at 4 bits and cost
# every key tile a turn in the kernel). int8 needs none of them.
# smooth = "auto" (docs/results/eval-smooth.json, eval-ruler-smooth.json), by the width of a layer's keys: at 2 bits
# strength 1 took perplexity from +2.51% to +0.92%, second copies from +45.7% to +34.2% and RULER's loss from 23.9 to
# 16.4 points; with 3-bit keys (int3, int2:key_bits=3) no strength beat none. Where rotate is None it means 0 (the
# scales act on what the rotation mixes).
# scale_dtype = "auto" (docs/results/eval-scales.json; benchmarks/window_kl.py): 8-bit scales where the codes are
# Hadamard-rotated (int3 / int2: KL divergence from DynamicCache through SmolLM2 over six windows 0.95x / 0.99x of
# float32 scales', perplexity and second copies within their noise, 7% fewer bytes at 8k tokens; int4: RULER and
# perplexity as its 16-bit scales', above); without a rotation the K/V dtype's (KIVI's int4 layout: KL 1.41x).
# residual_bits = "auto" (docs/results/eval-residual.json, eval-ruler-residual.json; benchmarks/window_kl.py): full
# precision at every width for now. At 2 bits a rotated int8 residual measured nearly free (KL from DynamicCache over
# six windows 1.004x, perplexity +0.90% against +0.78%, copies, passkeys and RULER at 1k unchanged) for 0.85x of int2's
# bytes at 2k tokens, but it decodes slower on the CPU (0.90x-0.94x of int2's tokens/s through SmolLM2),
# and a forward of several tokens is not decoding's (int8 rounds each token's numbers as a longer forward's float
# order gives them), so the harness scores it one token per forward. At 3 bits it costs KL 1.075x.
# int3 on RULER's needles (1k tokens, 400 documents: docs/results/eval-ruler-int3*.json, report-ruler-int3) loses
# 4.7 points; strength-1 smoothing, key groups of 32 and int8 boundary layers leave it -3.8 to -4.9, only 4-bit keys
# (key_bits=4, 0.251x of bf16 at 8k against 0.220x) buy it back (-0.6): int3 keeps these defaults, its bytes.
_PLAIN = {"rotate": None, "sinks": 0, "pre_rope": False, "smooth": 0.0, "scale_dtype": None, "residual_bits": None}
_ROTATED = {"rotate": "hadamard", "sinks": 4, "pre_rope": True, "scale_dtype": "e5m3"}
MEASURED_DEFAULTS = {
    8: _PLAIN,
    "fp8": _PLAIN,  # int8's bytes
    4: {**_ROTATED, "pre_rope": False, "smooth": 0.0, "residual_bits": None},
    3: {**_ROTATED, "smooth": 0.0, "residual_bits": None},
    2: {**_ROTATED, "smooth": 1.0, "residual_bits": None},
}


class QuantizedKVCache(PaddingObserverMixin, KVCacheReportMixin, Cache):
    """A KV cache that stores keys and values in 8, 4, 3 or 2 bits, for any ``generate()`` mode.

    * ``bits=8`` (default): symmetric absmax int8 with one float32 scale per token, head and ``group_size``
      channels (the whole head by default), about 0.52x of a bf16 cache at head_dim 128. Each token is encoded as it
      arrives; greedy decoding keeps the tokens of the default cache in our tests.
    * ``bits="fp8"``: float8 e4m3 codes with one scale per token and head (absmax / 448), as vLLM and TensorRT-LLM
      store KV caches: int8's bytes, with 3 mantissa bits at every magnitude instead of 255 even steps. Options as
      int8's, without ``group_size`` and ``backend``.
    * ``bits=4`` / ``bits=3`` / ``bits=2``: KIVI (https://arxiv.org/abs/2402.02750): keys quantized per channel over
      groups of ``group_size`` tokens, values per token over groups of ``group_size`` channels, asymmetric (scale +
      zero point), packed 2 or 4 codes per byte (3 bits: 8 codes in 3 bytes, as a 2-bit and a 1-bit plane), with the
      most recent ``residual_length`` tokens kept in full precision.
      ``key_axis="token"`` quantizes keys per token like the values instead: the paper's ablation (its per-token
      keys fail at 2 bits), offered to reproduce that finding, not for use.
    * ``rotate``, ``sinks``, ``pre_rope``, ``smooth``, ``scale_dtype`` and ``residual_bits`` default to ``"auto"``:
      the best setting measured at that width on the real model (:data:`MEASURED_DEFAULTS`: at 4, 3 and 2 bits
      ``rotate="hadamard", sinks=4`` and 8-bit scales, ``scale_dtype="e5m3"``; at 3 and 2 bits ``pre_rope=True`` too,
      where the model has RoPE; at 2 bits ``smooth=1``; at 8 bits none; ``residual_bits``: full precision at every
      width). KIVI's own layout is ``rotate=None, sinks=0, pre_rope=False`` (spec
      ``int2:rotate=none:sinks=0:pre_rope=false``, which also keeps 16-bit scales); at 4 bits it loses RULER needles
      that the rotation keeps.

    Every token is encoded exactly once (the prompt's tail stays in the residual; nothing is re-quantized), appends
    are amortized, and the K/V handed to attention are decoded into one workspace shared by all layers. On hybrid
    models the model's sliding-window layers are quantized too and keep only their window, as ``DynamicCache`` does.
    Non-finite values never poison a group (see :mod:`hf_kvcache.quant`). Latent-attention models (DeepSeek-V2/V3)
    cache latents whose key and value widths differ; each is quantized on its own.

    Lifecycle: a cache takes its batch size, dtype and device from its first forward; a forward that does not match
    raises ``ValueError``; ``reset()`` frees the storage and accepts anything a new cache would.

    Args:
        config: the model's ``PretrainedConfig``, or the model itself.
        bits: 8, ``"fp8"``, 4, 3 or 2 (the values' width where ``key_bits`` sets the keys').
        group_size: elements that share a scale. 8 bits: channels per scale group (default: the whole head, one scale
            per token and head). 4/3/2 bits: tokens per key group and channels per value group (default: the largest
            of 64, 32, 16, 8, 4, 2, 1 that divides the head width). Must divide the key and value widths.
        residual_length: most recent tokens kept in full precision (default 0 at 8 bits, 128 at 4, 3 and 2 bits, as in
            KIVI). Tokens leave the residual ``group_size`` at a time at 4/3/2 bits, so it holds between
            ``residual_length`` and ``residual_length + group_size - 1`` tokens once full.
        backend: ``"torch"`` or, for 8 bits, ``"bitsandbytes"`` (codes from ``bitsandbytes.functional.
            int8_vectorwise_quant``; needs the ``bnb`` extra).
        scale_dtype: dtype of scales and zero points: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or the torch
            dtype), ``None`` (float32 at 8 bits; at 4/3/2 bits the K/V dtype when it is 16-bit, else float32), or at
            4/3/2 bits ``"e5m3"``: 8-bit scales (float16's exponent and top 3 mantissa bits, on a grid centered on
            each group, every element within half a step) with int8 zero points in steps of ``2^(bits - 7)`` scales
            for the per-token groups (values, ``key_axis="token"``); per-channel key groups keep their zero points
            in the ``None`` dtype, their channel offsets being many steps from 0. At head_dim 64 or 128 with bf16
            K/V a token's scales and zero points shrink from 8 to 5 bytes per head (4 + 4 to 3 + 2). Default
            ``"auto"``: :data:`MEASURED_DEFAULTS` (``"e5m3"`` at 4, 3 and 2 bits with their rotation, else ``None``).
        key_axis: 4/3/2 bits only: ``"channel"`` (default, KIVI: one scale and zero point per channel over groups of
            ``group_size`` tokens) or ``"token"`` (KIVI's ablation: per token over groups of ``group_size`` channels,
            like the values; every token encoded on its own). Under the ``hf_kvcache`` attention per-token keys are
            read by the pure-torch reference kernel on every device (the Triton kernel reads per-channel keys only).
            Not accepted at 8 bits, whose keys are per token already.
        rotate: ``"auto"`` (default: :data:`MEASURED_DEFAULTS`), ``"hadamard"`` or ``None``: keys and values are
            rotated by an orthonormal Hadamard transform of the head dimension before quantizing and rotated back
            when decoded (QuaRot, TurboQuant): an outlier channel is spread over the other channels of its block
            (the largest power of two dividing the head width) instead of stretching its group's scale. Same
            bytes; under eager or sdpa each decode step costs one more ``(tokens x head_dim) @ (head_dim x
            head_dim)`` product per layer. Under the ``hf_kvcache`` attention the kernels read the codes in place
            with the rotation folded into the query and the output (two small products per layer and step).
        sinks: the first ``sinks`` real tokens of every row kept in full precision on full-attention layers
            (attention sinks, as KVQuant and StreamingLLM observe: most heads put much attention on the first tokens).
            Built from a model, the cache reads each row's left padding from the prefill's attention mask and keeps
            each row's own first real tokens, beside the codes of every position (which are computed without them:
            sinks and padding never set a group's range); built from a config, rows count as unpadded. A padded
            batch stores what unpadded rows do. Default ``"auto"`` (:data:`MEASURED_DEFAULTS`).
        pre_rope: quantize keys as they were before RoPE (KVQuant, https://arxiv.org/abs/2401.18079): RoPE turns each
            channel pair by a different angle every token, smearing an outlier channel over its pair, which
            per-channel key groups cannot follow; un-rotated, the channel is steady across tokens. Keys are turned
            back when encoded and forward when read, with the same float32 angles (the token's index in the layer),
            so the round trip is exact to float rounding, through ``crop``, beams and batch selection. Same bytes;
            a decode step rotates every quantized key once per layer (an elementwise pass, like dequantizing). Under
            the ``hf_kvcache`` attention the Triton kernel turns each tile of keys in registers (with
            ``rotate="hadamard"`` too, the reference kernel serves the quantized segment). Needs a model with RoPE
            (the rotation is read from its rotary embedding; layers without RoPE store keys as they are); ``True`` is
            refused for latent attention and models without RoPE, where ``"auto"`` leaves it off. Default
            ``"auto"`` (:data:`MEASURED_DEFAULTS`).
        boundary_layers: 4/3/2 bits only: the first and last ``boundary_layers`` decoder layers store int8 (as
            ``bits=8``: one scale per token and head, no residual, rotation, sinks or pre-RoPE keys) and the others
            ``bits``, as vLLM's low-bit presets keep the boundary layers at higher precision; at least one layer must
            stay at ``bits``. Default 0 (every layer at ``bits``). ``bytes_per_token``, ``nbytes`` and ``plan`` count
            each layer's own layout.
        key_bits: 4/3/2 bits only: the keys' width, 4, 3 or 2, the values staying at ``bits`` (default: ``bits``).
            Keys carry per-channel outliers and steer every attention weight; values are averaged by them, so
            ``bits=2, key_bits=4`` (spec ``int2:key_bits=4``, 3 bits per element on average) spends the bytes where
            the errors cost most, as vLLM's ``k8v4``-style KV presets do. Read in place by the kernels (each
            tile's keys and values unpacked at their own width), counted by ``bytes_per_token``, ``nbytes`` and
            ``plan``. The other options (residual, rotation, sinks, pre-RoPE keys, their ``"auto"`` defaults) follow
            ``bits``. Per layer: a sequence of widths, one per decoder layer, or the path of a widths file (spec
            ``int2:key_bits=widths.json``) that :func:`hf_kvcache.calibrate.search_key_bits` (``hf-kvcache
            calibrate``) writes after measuring which layers' keys cost most at fewer bits (KVTuner's idea); the
            attribute is then a tuple, :meth:`layer_key_bits` gives one layer's. ``"auto"`` (3 and 2 bits, built
            from the model, not its config): the widths that search finds for this model and cache on rows of random
            token ids under a quarter bit more per key element (:func:`hf_kvcache.calibrate.auto_key_bits`): the
            first cache of a model pays ``1 + 2 x layers`` forwards of 4 x 1,024 tokens (SmolLM2-135M: 256 s on
            one CPU thread), which are kept as a widths file under ``$HF_KVCACHE_CACHE`` for every later one.
        residual_bits: 4/3/2 bits only: ``None`` (the residual holds its tokens in full precision), 8 (the residual
            holds them in int8 as ``bits=8`` stores tokens, one float32 scale per token and head, Hadamard-rotated
            where the codes are: about half of a bf16 residual's bytes; at 2k tokens and 2 bits a bf16 residual is
            about 30% of what the cache stores) or ``"auto"`` (default: the measured default per width,
            :data:`MEASURED_DEFAULTS`; ``None`` at every width for now). The prompt's forward attends to its own
            tokens exactly (its logits are ``DynamicCache``'s); every later forward reads its new tokens
            int8-rounded, as the residual holds them and the next forwards read them. A token that waited in the
            residual joins the codes int8-rounded. Read by the int8 kernel under ``hf_kvcache``; counted by
            ``nbytes`` and ``plan``.
        codebook: 4/3/2 bits only: where each group's codes sit between its minimum and maximum. ``"uniform"``
            (default, KIVI's ``2^bits - 1`` equal steps) or ``"lloyd"``: Lloyd-Max levels for normally distributed
            groups (:func:`hf_kvcache.quant.codebook_levels`), the distribution Hadamard-rotated coordinates take
            (TurboQuant's scalar step, here inside KIVI's min / max frame): levels crowd where the values are, the
            extremes are rounded inward. Same bytes, the same scales and zero points; the kernels read each code's
            level from a table of ``2^bits`` numbers.
        smooth: 4/3/2 bits only: the strength of smoothed keys, from 0 (off) to 2 (above 0 with
            ``rotate="hadamard"``), or ``"auto"`` (default: :data:`MEASURED_DEFAULTS` by the width of each layer's
            keys, 1 for 2-bit keys, 0 for wider ones and where ``rotate`` is None; :meth:`layer_smooth`). Keys are
            stored times per-channel scales ``(E[k^2] / Var k) ** (smooth / 4)`` (one per RoPE channel pair,
            geometric mean 1), measured per layer, batch row and KV head when the layer first encodes real tokens
            of the row, on every token it then holds of the row (the chunk and the residual), and kept until
            ``reset()`` (a row's codes do not depend on the rows beside it); reads divide
            them back, and the kernels read the codes with the query divided instead
            (``q . k = (q / s) . (k * s)``: scores are unchanged). A channel whose keys share a large offset and
            vary little is where queries are large; the rotation spreads the other channels' rounding error into
            it, and its larger scale takes that error back out (SmoothQuant's migration, between keys and queries).
            Same bytes per token, plus one ``(heads, head_dim)`` float32 tensor per layer and row and its inverse;
            under the ``hf_kvcache`` attention one more elementwise product per layer and step (the query's).

    Example:
        >>> from transformers import LlamaConfig
        >>> from hf_kvcache import QuantizedKVCache
        >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> cache = QuantizedKVCache(config, bits=4, residual_length=32)
        >>> cache.bits, cache.group_size
        (4, 16)
    """

    def __init__(
        self,
        config: PretrainedConfig | torch.nn.Module,
        bits: int = 8,
        group_size: int | None = None,
        residual_length: int | None = None,
        backend: str = "torch",
        scale_dtype: str | torch.dtype | None = AUTO,
        key_axis: str | None = None,
        rotate: str | None = AUTO,
        sinks: int | str = AUTO,
        pre_rope: bool | str = AUTO,
        boundary_layers: int = 0,
        key_bits: int | Sequence[int] | LayerKeyWidths | str | os.PathLike | None = None,
        residual_bits: int | str | None = AUTO,
        codebook: str = "uniform",
        smooth: float | str = AUTO,
    ):
        # The options as given: key_bits="auto" measures the cache they build (their "auto"s resolved as here).
        given = dict(
            group_size=group_size, residual_length=residual_length, backend=backend, scale_dtype=scale_dtype,
            key_axis=key_axis, rotate=rotate, sinks=sinks, pre_rope=pre_rope, residual_bits=residual_bits,
            codebook=codebook, smooth=smooth,
        )  # fmt: skip
        model, config = split_model(config)
        check_choice("bits", bits, (*quant.SUPPORTED_BITS, "fp8"))
        width = 8 if bits == "fp8" else bits  # bits per stored element
        if key_axis is not None:
            check_choice("key_axis", key_axis, KEY_AXES)
            if width == 8:
                raise ValueError(
                    f"key_axis applies to the 4/3/2-bit KIVI kinds only (8-bit keys are quantized per token already), "
                    f"got key_axis={key_axis!r} with bits={bits!r}"
                )
        if bits == "fp8" and group_size is not None:
            raise ValueError(f"group_size: fp8 keeps one scale per token and head; leave it unset, got {group_size!r}")
        measured = MEASURED_DEFAULTS[bits]
        if rotate == AUTO:
            rotate = measured["rotate"]
        elif rotate is not None:
            check_choice("rotate", rotate, (AUTO, *ROTATIONS, None))
        if isinstance(sinks, str) and sinks != AUTO:
            raise ValueError(f"sinks must be an integer >= 0 or 'auto', got {sinks!r}")
        sinks = measured["sinks"] if sinks == AUTO else check_int("sinks", sinks, 0)
        auto_pre_rope = pre_rope == AUTO
        if not auto_pre_rope and not isinstance(pre_rope, bool):
            raise ValueError(f"pre_rope must be True, False or 'auto', got {pre_rope!r}")
        pre_rope = measured["pre_rope"] if auto_pre_rope else pre_rope
        check_choice("backend", backend, _BACKENDS)
        if backend == "bitsandbytes":
            if bits != 8:
                raise ValueError(f"backend='bitsandbytes' supports bits=8 only, got bits={bits!r}")
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as err:
                raise ImportError("backend='bitsandbytes' needs bitsandbytes: pip install 'hf-kvcache[bnb]'") from err
        if residual_bits == AUTO:
            residual_bits = measured["residual_bits"] if rotate else None
        elif residual_bits is not None:
            check_choice("residual_bits", residual_bits, (8, None, AUTO))
        check_choice("codebook", codebook, quant.CODEBOOKS)
        check_int("boundary_layers", boundary_layers, 0)
        for name, value, why in (
            ("key_bits", key_bits, "their keys at another of those widths"),
            ("residual_bits", residual_bits, "whose residual is otherwise full precision"),
            ("boundary_layers", boundary_layers, "it stores their first and last layers in int8"),
            ("codebook", codebook != "uniform" and codebook, "it places their codes between each group's extremes"),
            ("smooth", smooth != AUTO and smooth, "it scales the keys their rotation mixes"),
        ):
            if value and width == 8:  # set (not None / 0) where the kind has no such layout
                raise ValueError(
                    f"{name} applies to the 4/3/2-bit kinds ({why}), got {name}={value} with bits={bits!r}"
                )
        smooth = smooth if smooth == AUTO else _check_smooth(smooth, rotate)
        specs = self._bind_model(model, config)
        if key_bits == AUTO:
            if model is None:
                raise ValueError(
                    "key_bits='auto' measures the model's layers: build the cache from the model "
                    "(QuantizedKVCache(model, bits=2, key_bits='auto')), not from its config; from a config (as plan "
                    "reads), name the widths file the search kept: key_bits=PATH, under $HF_KVCACHE_CACHE/key_bits"
                )
            if boundary_layers:
                raise ValueError("boundary_layers: key_bits='auto' chooses every layer's key width; leave it at 0")
            key_bits = auto_key_bits(model, bits, **given)
        layers = decoder_layers(specs)  # a loop layer takes its decoder layer's options
        key_bits = resolve_key_bits(key_bits, layers)
        if 2 * boundary_layers >= layers:
            raise ValueError(
                f"boundary_layers={boundary_layers} keeps the first and last {boundary_layers} of the model's "
                f"{layers} layers in int8, leaving none at {bits} bits: use at most {(layers - 1) // 2}, or bits=8"
            )
        widths = sorted({d for s in specs for d in (s.key_dim, s.value_dim)})
        if group_size is None and width != 8:
            group_size = next(g for g in (64, 32, 16, 8, 4, 2, 1) if all(d % g == 0 for d in widths))
        if group_size is not None:
            check_int("group_size", group_size, 1)
            if any(d % group_size for d in widths):
                raise ValueError(f"group_size must divide head_dim ({', '.join(map(str, widths))}), got {group_size}")
        key_dims, value_dims = {s.key_dim for s in specs}, {s.value_dim for s in specs}
        key_widths = {width} if key_bits is None else set(key_bits) if isinstance(key_bits, tuple) else {key_bits}
        coded = [(width, value_dims), *((b, key_dims) for b in sorted(key_widths))]
        for code_bits, dims in coded:
            per_pack = quant.codes_per_byte(code_bits)
            if any(d % per_pack for d in dims):
                raise ValueError(
                    f"{code_bits}-bit codes pack {per_pack} per whole bytes: head widths {sorted(dims)} must be "
                    "multiples"
                )
        residual_length = _DEFAULT_RESIDUAL[width] if residual_length is None else residual_length
        check_int("residual_length", residual_length, 0)
        if scale_dtype == AUTO:
            scale_dtype = measured["scale_dtype"] if rotate else None
        if scale_dtype == E5M3_NAME:
            if width == 8:
                raise ValueError(
                    f"scale_dtype='e5m3' applies to the 4/3/2-bit kinds (8-bit scales beside their asymmetric codes), "
                    f"got it with bits={bits!r}: use float32, float16 or bfloat16"
                )
        elif scale_dtype is not None:
            scale_dtype = dtype_from_name("scale_dtype", scale_dtype, _SCALE_DTYPES if width == 8 else _KIVI_SCALES)

        self.bits, self.residual_length = bits, residual_length
        self.key_bits = bits if key_bits is None else key_bits
        self.residual_bits = residual_bits
        self.codebook = codebook
        self._smooth = smooth  # "auto": per layer, by the width of its keys (layer_smooth)
        # int8's default group is the whole head (a width per tensor); report it as an int when all widths agree.
        self.group_size = group_size if group_size is not None or len(widths) > 1 else widths[0]
        self._codec_group = group_size
        self.backend, self.scale_dtype = backend, scale_dtype
        self.key_axis = None if width == 8 else key_axis or "channel"
        self.rotate = rotate
        self.sinks = sinks
        self.pre_rope = pre_rope
        self.boundary_layers = boundary_layers
        self.key_ropes = {}
        if pre_rope:
            try:
                self.key_ropes = _key_ropes(model, config, specs)
            except ValueError:
                if not auto_pre_rope:
                    raise
                self.pre_rope = False  # "auto" applies it where the model has a RoPE to undo
        self.workspace = Workspace()
        self._reads_padding = False  # set by _make_layer: whether any layer reads its rows' left padding
        owner = type(self).__name__
        super().__init__(
            layers=[cache_layer(s, i, owner, partial(self._make_layer, i, s)) for i, s in enumerate(specs)]
        )
        if self._reads_padding:  # each row's left padding, from the prefill's mask (QuantizedLayer.reads_padding)
            self._observe_model(model)

    @property
    def smooth(self) -> float | str:
        """The smoothed keys' strength: one number, or ``"auto"`` where layers differ (:meth:`layer_smooth`: a
        per-layer ``key_bits`` with 2-bit keys on some layers only)."""
        strengths = {self.layer_smooth(i) for i in range(len(self.layer_specs)) if not self.is_boundary(i)}
        return strengths.pop() if len(strengths) == 1 else AUTO

    def layer_smooth(self, layer_idx: int) -> float:
        """The strength layer ``layer_idx`` smooths its keys with: the one given, or for ``"auto"`` the measured
        default of its keys' width (:data:`MEASURED_DEFAULTS`: 1 for 2-bit keys, else 0; 0 without a rotation and on
        int8 boundary layers)."""
        if self.bits in (8, "fp8") or self.is_boundary(layer_idx):
            return 0.0
        if self._smooth != AUTO:
            return self._smooth
        return MEASURED_DEFAULTS[self.layer_key_bits(layer_idx)]["smooth"] if self.rotate else 0.0

    def layer_key_bits(self, layer_idx: int) -> int:
        """The width layer ``layer_idx`` stores its keys at (8 for an int8 boundary layer)."""
        if self.bits in (8, "fp8") or self.is_boundary(layer_idx):
            return 8
        if isinstance(self.key_bits, tuple):
            return self.key_bits[decoder_layer(self.layer_specs, layer_idx)]
        return self.key_bits

    def _codec(self, layer_idx: int):
        group = self._codec_group if self.bits in (8, "fp8") else self.group_size
        key_bits = self.layer_key_bits(layer_idx)
        key_bits = None if key_bits in (8, self.bits) else key_bits
        scale_dtype = quant.E5M3 if self.scale_dtype == E5M3_NAME else self.scale_dtype
        return codec_for(
            self.bits, group, scale_dtype, self.key_axis, self.rotate, self.backend, key_bits, self.codebook
        )

    def is_boundary(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is one of the first or last ``boundary_layers``, stored in int8."""
        layer_idx = decoder_layer(self.layer_specs, layer_idx)
        return layer_idx < self.boundary_layers or layer_idx >= decoder_layers(self.layer_specs) - self.boundary_layers

    def _make_layer(self, layer_idx: int, spec: LayerSpec) -> QuantizedLayer:
        owner = type(self).__name__
        key_rope = self.key_ropes.get(spec.layer_type) if spec.uses_rope else None
        residual, sinks, smooth = self.residual_length, self.sinks, self.layer_smooth(layer_idx)
        # int8 as bits=8 stores it, Hadamard-rotated where the codes are (their outliers spread over the head's
        # channels, which one absmax scale per token then resolves finer), or None: exact
        residual_codec = codec_for(self.residual_bits, rotate=self.rotate)
        if self.is_boundary(layer_idx):  # int8 as bits=8 stores it: no residual, rotation, sinks or pre-RoPE keys
            codec = codec_for(8, None, None if self.scale_dtype == E5M3_NAME else self.scale_dtype)
            key_rope, residual, sinks, residual_codec = None, 0, 0, None
        else:
            codec = self._codec(layer_idx)
        if spec.layer_type != "full_attention":  # the model's own window: its sinks would be evicted anyway
            layer = QuantizedSlidingWindowLayer(
                spec, layer_idx, owner, codec, residual, self.workspace, self.attention_mode, key_rope, residual_codec,
                smooth, self.padding,
            )  # fmt: skip
        else:
            layer = QuantizedLayer(
                spec, layer_idx, owner, codec, residual, self.workspace, self.attention_mode, sinks, self.padding,
                key_rope, residual_codec, smooth,
            )  # fmt: skip
        self._reads_padding = self._reads_padding or layer.reads_padding
        return layer

    def before_forward(self, kwargs: dict) -> None:
        if self.get_seq_length() == 0:  # the sinks are placed at the prefill; later masks are not needed
            super().before_forward(kwargs)

    def _observes_forwards(self) -> bool:
        return self._reads_padding

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Analytic stored bytes per quantized token, summed over layers, for K/V of ``dtype``.

        Excludes the constant-size residual; sliding layers stop growing once their window is full.
        """
        return sum(
            layer.codec.bytes_per_token(spec.num_kv_heads, spec.key_dim, spec.value_dim, dtype)
            for spec, layer in zip(self.layer_specs, self.layers)
            if spec.holds_kv
        )

    def __repr__(self) -> str:
        axis = f", key_bits={self.key_bits}" if self.key_bits != self.bits else ""  # a tuple: one width per layer
        axis += f", key_axis={self.key_axis!r}" if self.key_axis == "token" else ""
        axis += f", rotate={self.rotate!r}" if self.rotate else ""
        axis += f", sinks={self.sinks}" if self.sinks else ""
        axis += ", pre_rope=True" if self.pre_rope else ""
        axis += f", boundary_layers={self.boundary_layers}" if self.boundary_layers else ""
        axis += f", residual_bits={self.residual_bits}" if self.residual_bits else ""
        axis += f", codebook={self.codebook!r}" if self.codebook != "uniform" else ""
        axis += f", smooth={self.smooth!r}" if self.smooth else ""
        axis += f", scale_dtype={self.scale_dtype!r}" if self.scale_dtype is not None else ""
        return (
            f"{type(self).__name__}(bits={self.bits!r}, group_size={self.group_size}, "
            f"residual_length={self.residual_length}, backend={self.backend!r}{axis}, layers={len(self.layers)})"
        )


def _check_smooth(smooth, rotate: str | None) -> float:
    """``smooth`` as a float in ``[0, MAX_SMOOTH]``; above 0 it needs Hadamard-rotated codes."""
    if isinstance(smooth, bool) or not isinstance(smooth, (int, float)) or not 0 <= smooth <= MAX_SMOOTH:
        raise ValueError(f"smooth must be a number from 0 (off) to {MAX_SMOOTH} or 'auto', got {smooth!r}")
    if smooth and rotate is None:
        raise ValueError(
            f"smooth={smooth} scales the keys before the Hadamard rotation mixes their channels; without it each "
            "channel's offset is stored by its own zero point and there is nothing to move: set rotate='hadamard' "
            "or smooth=0"
        )
    return float(smooth)


def _key_ropes(model, config, specs: list[LayerSpec]) -> dict[str, RotarySpec]:
    """The rotation each layer type applies to its keys, for ``pre_rope=True`` (refused where there is none)."""
    name = getattr(config, "model_type", type(config).__name__)
    if is_latent_attention(config):
        raise ValueError(
            f"pre_rope=True: model_type {name!r} uses latent attention, whose cached keys carry RoPE on a part of "
            "their channels only; use pre_rope=False"
        )
    ropes = {}
    for layer_type in sorted({s.layer_type for s in specs if s.uses_rope}):
        # Built from the config (float32 frequencies whatever the model's dtype, so a reset cache serves a model of
        # another dtype as a new one would); the model's own module where the config alone cannot find it.
        try:
            rope = rotary_spec(config, config, layer_type, way_out="pre_rope=False")
        except ValueError:
            if model is None:
                raise
            rope = rotary_spec(model, config, layer_type, way_out="pre_rope=False")
        if rope is not None:
            ropes[layer_type] = rope
    if not ropes:
        raise ValueError(
            f"pre_rope=True: model_type {name!r} does not rotate its keys with RoPE, so there is nothing to quantize "
            "before; use pre_rope=False"
        )
    return ropes


def _register(bits: int | str, summary: str) -> None:
    def factory(
        config,
        group_size: int | None = None,
        residual_length: int | None = None,
        backend: str = "torch",
        scale_dtype: str | None = AUTO,
        key_axis: str | None = None,
        rotate: str | None = AUTO,
        sinks: int | str = AUTO,
        pre_rope: bool | str = AUTO,
        boundary_layers: int = 0,
        key_bits: int | str | None = None,
        residual_bits: int | str | None = AUTO,
        codebook: str = "uniform",
        smooth: float | str = AUTO,
    ) -> QuantizedKVCache:
        return QuantizedKVCache(
            config, bits, group_size, residual_length, backend, scale_dtype, key_axis, rotate, sinks, pre_rope,
            boundary_layers, key_bits, residual_bits, codebook, smooth,
        )  # fmt: skip

    # key_axis is a KIVI option, group_size and backend int8 / KIVI ones: a spec that names an option its kind does
    # not have is refused by name.
    options = ("residual_length", "scale_dtype", "rotate", "sinks", "pre_rope")
    if bits != "fp8":
        options = ("group_size", *options[:1], "backend", *options[1:])
    if bits not in (8, "fp8"):
        options += ("key_bits", "residual_bits", "key_axis", "boundary_layers", "codebook", "smooth")
    register_cache("fp8" if bits == "fp8" else f"int{bits}", summary, options=options)(factory)


_register(8, "QuantizedKVCache bits=8: int8 per token and head, ~0.52x of bf16")
_register("fp8", "QuantizedKVCache bits='fp8': float8 e4m3 per token and head, ~0.52x of bf16")
_register(4, "QuantizedKVCache bits=4: KIVI 4-bit with a 128-token fp residual, ~0.28x of bf16 + residual")
_register(
    3,
    "QuantizedKVCache bits=3: KIVI 3-bit (8 codes in 3 bytes), Hadamard-rotated, pre-RoPE keys, 8-bit scales, 4 fp "
    "sinks and a 128-token fp residual, ~0.21x of bf16 + residual",
)
_register(
    2,
    "QuantizedKVCache bits=2: KIVI 2-bit, Hadamard-rotated, pre-RoPE smoothed keys, 8-bit scales, 4 fp sinks and a "
    "128-token fp residual, ~0.14x of bf16 + residual",
)
