"""What fits in my GPU: KV bytes per token, the largest context and the largest batch per cache, from a config alone.

``plan_memory(config, memory="24GiB", context=8192, batch=1)`` answers, for each cache spec, how many bytes the
cache stores for ``batch`` rows of ``context`` tokens, and how far the context (at that batch) and the batch (at that
context) can grow before the weights, the caches' decode scratch and a reserve for activations fill the memory. It
reads only the model's config (hybrid layer types, GQA, head_dim, latent attention widths): no weights load, nothing
is allocated. ``hf-kvcache plan`` prints the same numbers.

The stored bytes follow each cache's storage layout token for token (``tests/test_plan.py`` checks them against the
caches' ``nbytes`` after real forwards, for every kind and for hybrid models):

* ``dynamic``: every token of a full layer in the K/V dtype; a sliding layer keeps its last ``sliding_window - 1``.
* ``int8`` / ``int4`` / ``int2``: the most recent ``residual_length`` tokens (and, for KIVI, up to ``group_size - 1``
  more, until a whole key group can be encoded) in the K/V dtype, the rest as codes with their scales (and zero
  points); a model's sliding layers the same within their window.
* ``sink``: at most ``sinks + window`` tokens per full layer, whatever the context.
* ``paged``: whole blocks of ``block_size`` tokens; with ``share=N`` (a plan option, not a cache option), groups of
  ``N`` rows share the full blocks of one prompt (``num_return_sequences=N`` sampling or beams) and store only what
  each generates.

A hybrid model's recurrent states (Mamba, gated DeltaNet, convolutions) are the same in every cache and do not grow
with the context: :func:`state_bytes` measures one row's, and the plan adds them per row to what must fit.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._compat import with_cache
from ._config import LayerSpec, has_state_layers, layer_specs, model_type, resolve_config
from ._validate import check_int, dtype_from_name
from .attention import ATTENTION
from .layers._common import check_takes_a_cache
from .layers.window import dynamic_layer_nbytes
from .registry import check_spec, make_cache, parse_spec

__all__ = [
    "DEFAULT_PLAN_CACHES",
    "PLAN_ATTENTIONS",
    "MemoryPlan",
    "PlanRow",
    "kv_bytes",
    "parse_memory",
    "plan_memory",
    "state_bytes",
    "weight_bytes",
]

DEFAULT_PLAN_CACHES = (
    "dynamic",
    "int8",
    "fp8",
    "int4",
    "int3",
    "int2",
    "sink:window=1024:sinks=4",
    "sink:window=4096:sinks=4",
    "paged",
    "paged:share=8",
    "paged:bits=8",
)
PLAN_ATTENTIONS = ("eager", "sdpa", ATTENTION)  # how decoding reads the cache: what scratch it needs
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: str | int | float, name: str = "memory") -> int:
    """Bytes of ``"24GiB"``, ``"80GB"``, ``"512MiB"`` or a plain number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match[2].lower() not in _UNITS or float(match[1]) <= 0:
        raise ValueError(f"{name} must be a positive size such as 24GiB, 80GB or 512MiB, got {value!r}")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# --- stored bytes ----------------------------------------------------------------------------------------------


def _plan_spec(spec: str) -> tuple[str, dict, int | None, int]:
    """``(kind, cache options, share, generated)`` of a plan spec: a cache spec, plus ``share`` / ``generated`` for
    paged specs. Kind and option names are checked here; option values when the cache is built."""
    name, options = parse_spec(spec)
    for option in ("share", "generated"):
        if option in options and name != "paged":
            raise ValueError(f"{option}= is a plan option of paged specs only, got {spec!r}")
    if "generated" in options and "share" not in options:
        raise ValueError(f"generated= sizes the shared prompt of paged:share=N specs; add share=N, got {spec!r}")
    share, generated = options.pop("share", None), options.pop("generated", 256)
    if share is not None:
        check_int("share", share, 1)
        check_int("generated", generated, 0)
    check_spec(name, **options)
    return name, options, share, generated


def _layers_nbytes(cache, specs: list[LayerSpec], tokens: int, dtype: torch.dtype, prompt: int | None) -> list[float]:
    """Bytes one row of each layer stores after ``tokens`` tokens: our layers know their layout
    (``planned_nbytes``); transformers' ``DynamicCache`` layers are planned here."""
    layers = getattr(cache, "layers", [])
    if len(layers) == len(specs) and all(hasattr(layer, "planned_nbytes") for layer in layers):
        return [layer.planned_nbytes(tokens, dtype, prompt) for layer in layers]
    return [dynamic_layer_nbytes(spec, tokens, dtype) for spec in specs]


def kv_bytes(
    spec: str,
    config,
    tokens: int,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    prompt: int | None = None,
    tp: int = 1,
) -> int:
    """Bytes ``make_cache(spec, config)`` stores for ``batch`` rows of ``tokens`` tokens of K/V in ``dtype``, taken
    as a ``prompt``-token forward (default: all ``tokens``) and then one token per forward (only a quantized cache's
    sliding layers depend on the path, by less than a key group).

    ``paged:share=N``: rows come in groups of ``N`` that share one prompt of ``tokens - generated`` tokens, where
    ``generated`` is the spec's ``generated`` option (default 256): the prompt's full blocks are stored once per
    group, every row stores its own last prompt block and what it generates.

    ``tp``: the bytes of one rank under tensor parallelism with ``tp`` ranks, each holding ``1 / tp`` of every
    layer's KV heads (every layout stores per head, so that is exactly ``1 / tp`` of the bytes).

    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    >>> kv_bytes("dynamic", config, tokens=100, dtype=torch.float32)  # 2 layers x 2 heads x (32 + 32) x 4 bytes x 100
    102400
    """
    check_int("tokens", tokens, 0)
    check_int("batch", batch, 1)
    check_int("tp", tp, 1)
    model = config if isinstance(config, torch.nn.Module) else None  # its attention modules may override widths
    if model is not None:
        check_takes_a_cache(model, resolve_config(config))
    layer_specs(resolve_config(config), "plan", tp)  # the degree must divide every layer's KV heads
    if tp > 1:
        return kv_bytes(spec, config, tokens, batch, dtype, prompt) // tp
    name, options, share, generated = _plan_spec(spec)
    cache = make_cache(name, config, **options)
    specs = layer_specs(resolve_config(config), "plan", model=model)
    if share is None or share == 1:
        return int(batch * sum(_layers_nbytes(cache, specs, tokens, dtype, prompt)))
    prompt = max(0, tokens - generated)
    shared = prompt // cache.block_size * cache.block_size  # the prompt's full blocks, stored once per group
    groups = math.ceil(batch / share)
    each = _layers_nbytes(cache, specs, tokens, dtype, prompt)
    once = _layers_nbytes(cache, specs, shared, dtype, None)
    total = 0.0
    for s, row, common in zip(specs, each, once):
        if s.layer_type != "full_attention" and s.sliding_window:  # a model's own sliding layers are not shared
            total += batch * row
        else:
            total += groups * common + batch * (row - common)
    return int(total)


# --- recurrent states ------------------------------------------------------------------------------------------


def _zero_experts(model: torch.nn.Module) -> None:
    """Give every mixture-of-experts block of a meta model an expert computation that keeps its input's shape and
    routes nothing: their routing is data-dependent (``nonzero`` has no meta implementation), and experts hold no
    cache state. transformers' expert containers (``use_experts_implementation``) are told by the attributes their
    ``__init__`` sets."""

    def zeros(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)

    for module in model.modules():
        if hasattr(module, "is_concatenated") and hasattr(module, "has_gate"):
            module.forward = zeros


def _skip_sparse_attention(model: torch.nn.Module) -> None:
    """Give every sparse attention of a meta model (an attention module with an ``indexer``: DeepSeek-V3.2, GLM-5,
    Qwen4-Exp, GLM-5-Next) an output of its input's shape and no weights: its indexer picks tokens by data
    (``nonzero`` has no meta implementation), and attention keeps per-token K/V, counted apart, not recurrent state."""

    def zeros(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None

    def zeros_and_picks(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None, None

    for module in model.modules():
        if not hasattr(module, "indexer"):
            continue
        # GLM-5-Next's layers return their picks too, for the next layer ("shared", whose indexer is None) to reuse
        hands_on = "prev_topk_indices" in inspect.signature(module.forward).parameters
        if hands_on or isinstance(module.indexer, torch.nn.Module):
            module.forward = zeros_and_picks if hands_on else zeros


def _measure_states(config, dtype: torch.dtype) -> int:
    from transformers import AutoModel, AutoModelForCausalLM, DynamicCache
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .memory import recurrent_state_bytes

    # The decoder alone where the text config has no causal-LM class (GLM-5-Next's, under an image-text-to-text model)
    auto = AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype).eval()
    _zero_experts(model)
    _skip_sparse_attention(model)
    cache = DynamicCache(config=model.config)
    ids = torch.zeros((1, 4), dtype=torch.long, device="meta")
    with torch.no_grad():
        model(input_ids=ids, **with_cache(model, cache), use_cache=True)
    return recurrent_state_bytes(cache)


_STATE_BYTES: dict[tuple[str, torch.dtype], int] = {}  # per config (its JSON) and dtype: a plan asks many times


def state_bytes(config, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Bytes of the recurrent states one row of a hybrid model holds (Mamba, gated DeltaNet, convolution layers),
    whatever its length: what ``DynamicCache`` and every cache here keep beside the K/V, in the dtypes the model
    keeps them in when its weights are ``dtype`` (some mixers keep float32 states). 0 for attention-only models.

    Measured, not modelled: one forward of four tokens through the model built from the config on the meta device
    (no memory is allocated; the experts of a mixture-of-experts block route nothing there, as their routing is
    data-dependent and they hold no state), then the states ``DynamicCache`` received. ``tp``: one rank's share, the
    states split with the heads (an approximation: the mixers' tensor-parallel plans decide)."""
    config = resolve_config(config)
    check_int("tp", tp, 1)
    if not has_state_layers(config):
        return 0
    key = (config.to_json_string(use_diff=False), dtype)
    if key not in _STATE_BYTES:
        try:
            total = _measure_states(config, dtype)
        except Exception as err:  # a mixer the meta device cannot run: say so rather than plan without its states
            first = (str(err).strip().splitlines() or [""])[0][:160]
            raise ValueError(
                f"plan cannot measure the recurrent states of model_type {model_type(config)!r} on the meta device "
                f"({type(err).__name__}: {first})"
            ) from err
        if len(_STATE_BYTES) > 32:
            _STATE_BYTES.clear()
        _STATE_BYTES[key] = total
    return -(-_STATE_BYTES[key] // tp)


# --- weights ---------------------------------------------------------------------------------------------------


def weight_bytes(config, dtype: torch.dtype = torch.bfloat16, weights_bits: int = 16) -> dict:
    """Parameters and bytes of the weights, from the config (the model is built on the meta device).

    ``weights_bits`` 8 or 4: bitsandbytes quantizes the decoder's ``nn.Linear`` weights (int8 with one float32
    scale per row; NF4 with one float32 absmax per 64 weights); embeddings, norms and the output head stay in
    ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    check_int("weights_bits", weights_bits, 4)
    if weights_bits not in (4, 8, 16, 32):
        raise ValueError(f"weights_bits must be 16, 8 or 4 (32: float32 weights), got {weights_bits}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linear, rows, other = 0, 0, 0
    seen = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, torch.nn.Linear) and module is not head and p.ndim == 2:
                linear += p.numel()
                rows += p.shape[0]
            else:
                other += p.numel()
    itemsize = 4 if weights_bits == 32 else dtype.itemsize
    if weights_bits in (16, 32):
        quantized = linear * itemsize
    elif weights_bits == 8:
        quantized = linear + rows * 4
    else:
        quantized = linear // 2 + linear // 64 * 4
    return {"parameters": linear + other, "bytes": int(quantized + other * itemsize)}


# --- the plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRow:
    """One cache of a :class:`MemoryPlan`."""

    cache: str
    bytes_per_token: float  # per row, at the plan's context: stored bytes / context
    kv_bytes: int  # stored for the plan's batch x context
    scratch_bytes: int  # decode scratch for the plan's batch x context (one layer's dequantized history)
    fits: bool  # kv + states + scratch fit in the budget at the plan's batch and context
    max_context: int | None  # largest context at the plan's batch; None: any context (bounded cache)
    max_batch: int  # largest batch at the plan's context (0: not even one row)


@dataclass
class MemoryPlan:
    """The answer of :func:`plan_memory`; ``table()`` renders it, ``assumptions`` says what it assumed."""

    model: str
    memory_bytes: int
    weights_bytes: int
    reserve_bytes: int
    budget_bytes: int  # memory - weights - reserve: what caches and their scratch may use
    state_bytes_per_row: int  # a hybrid model's recurrent states, per row, in every cache (0: attention only)
    context: int
    batch: int
    dtype: str
    weights_bits: int
    rows: list[PlanRow]
    assumptions: list[str] = field(default_factory=list)

    def row(self, cache: str) -> PlanRow:
        return next(r for r in self.rows if r.cache == cache)

    def table(self) -> str:
        from tabulate import tabulate

        body = [
            [
                r.cache,
                f"{r.bytes_per_token:,.0f}",
                _gib(r.kv_bytes),
                _gib(r.scratch_bytes),
                "yes" if r.fits else "no",
                "any" if r.max_context is None else f"{r.max_context:,}",
                f"{r.max_batch:,}",
            ]
            for r in self.rows
        ]
        headers = [
            "cache",
            "KV bytes/token",
            f"KV at {self.batch} x {self.context:,}",
            "decode scratch",
            "fits",
            f"max context (batch {self.batch})",
            f"max batch ({self.context:,} tokens)",
        ]
        head = (
            f"{self.model}: {_gib(self.memory_bytes)} = weights {_gib(self.weights_bytes)} ({self.weights_bits}-bit) "
            f"+ reserve {_gib(self.reserve_bytes)} + {_gib(self.budget_bytes)} for the KV cache; K/V in {self.dtype}"
        )
        notes = "\n".join(f"- {a}" for a in self.assumptions)
        return f"{head}\n\n{tabulate(body, headers=headers, tablefmt='github', disable_numparse=True)}\n\n{notes}"


@functools.lru_cache
def _decodes_into_workspace(kind: str) -> bool:
    """Whether a cache kind hands eager / sdpa attention its history decoded into a shared workspace (the quantized
    kinds), told from a cache of that kind built for a one-layer config."""
    from transformers import LlamaConfig

    from .caches import QuantizedKVCache

    tiny = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    return isinstance(make_cache(kind, tiny), QuantizedKVCache)


def _scratch(spec: str, config, tokens: int, batch: int, dtype: torch.dtype, tp: int = 1, attn: str = "sdpa") -> int:
    """Decode scratch of the quantized caches under eager / sdpa attention: one workspace per distinct layer width,
    shared by the layers, holding a layer's dequantized history (with the buffers' growth headroom). Sink and paged
    caches and ``DynamicCache`` hand attention their own tensors or a gather that is freed per layer; under the
    ``hf_kvcache`` attention the quantized caches read their codes in place and need none."""
    from .layers._storage import _grown_capacity

    if attn == ATTENTION or not _decodes_into_workspace(_plan_spec(spec)[0]):
        return 0
    widths = {}
    for s in layer_specs(resolve_config(config), "plan"):
        stored = tokens if s.layer_type == "full_attention" or not s.sliding_window else min(tokens, s.sliding_window)
        key = (s.num_kv_heads, s.key_dim, s.value_dim)
        widths[key] = max(widths.get(key, 0), stored)
    return sum(
        batch * _grown_capacity(stored + 1, 1) * (h // tp) * (dk + dv) * dtype.itemsize
        for (h, dk, dv), stored in widths.items()
    )


def _largest(fits, low: int, high: int) -> int:
    """Largest ``n`` in ``[low, high]`` with ``fits(n)`` (monotone), or ``low - 1``."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def plan_memory(
    config,
    memory: str | int,
    context: int | None = None,
    batch: int = 1,
    dtype: torch.dtype | str = torch.bfloat16,
    weights_bits: int = 16,
    caches: tuple[str, ...] | list[str] | None = None,
    reserve: str | int | None = None,
    max_context: int = 2**24,
    tp: int = 1,
    attn: str = "sdpa",
) -> MemoryPlan:
    """Plan the KV cache of a model (a ``PretrainedConfig``, a model, a local folder, a ``config.json`` or a hub id)
    for ``memory`` bytes (``"80GiB"``): per cache spec, bytes, largest context at ``batch``, largest batch at
    ``context`` (default: the model's ``max_position_embeddings``).

    ``reserve`` (default 1 GiB + 5% of ``memory``) stands for everything else: the CUDA context, activations of the
    prefill (chunk long prompts with ``prefill_chunk_size`` to keep them small), the logits, allocator
    fragmentation. ``max_context`` caps the search (bounded caches report ``None``: any context). ``tp``: plan one
    rank of ``tp`` under tensor parallelism (``memory`` is one device's; each rank holds ``1 / tp`` of the KV heads,
    exactly, and of the weights, approximately). ``attn``: the attention implementation decoding will use:
    ``"eager"`` / ``"sdpa"`` (the quantized caches dequantize one layer's history per step into a workspace, counted
    as scratch) or ``"hf_kvcache"`` (they read their codes in place: no scratch). ``caches``: the specs to plan;
    default :data:`DEFAULT_PLAN_CACHES` less those that refuse the model (latent attention refuses the sink window's
    re-rotation, for one), which the assumptions name with the reason; a spec given here that refuses the model is
    its ``ValueError``.

    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(num_hidden_layers=16, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    >>> plan = plan_memory(config, "1GiB", context=4096, caches=("dynamic", "int4"), reserve="256MiB")
    >>> plan.row("dynamic").max_batch, plan.row("int4").max_batch
    (38, 101)
    """
    label = str(config) if isinstance(config, (str, Path)) else None
    config = _load_config(config)
    name = model_type(config) + (f" ({label})" if label else "")
    memory_bytes = parse_memory(memory, "memory")
    reserve_bytes = (2**30 + memory_bytes // 20) if reserve is None else parse_memory(reserve, "reserve")
    if isinstance(dtype, str):
        dtype = dtype_from_name("dtype", dtype)
    check_int("batch", batch, 1)
    check_int("tp", tp, 1)
    if attn not in PLAN_ATTENTIONS:
        raise ValueError(f"attn must be one of {', '.join(PLAN_ATTENTIONS)}, got {attn!r}")
    layer_specs(config, "plan", tp)  # the degree must divide every layer's KV heads
    context = context if context is not None else getattr(config, "max_position_embeddings", None) or 4096
    check_int("context", context, 1)
    skipped = {}
    if caches is None:  # the defaults this model accepts
        caches = []
        for spec in DEFAULT_PLAN_CACHES:
            try:
                kv_bytes(spec, config, 1, dtype=dtype, tp=tp)
            except ValueError as err:
                skipped[spec] = str(err).splitlines()[0]
            else:
                caches.append(spec)
        if not caches:
            raise ValueError(f"none of the default caches serves this model: {next(iter(skipped.values()))}")
    if not caches:
        raise ValueError("caches must name at least one cache spec")
    for spec in caches:
        _plan_spec(spec)
    weights = weight_bytes(config, dtype, weights_bits)
    weights["bytes"] = -(-weights["bytes"] // tp)
    if reserve_bytes >= memory_bytes:
        raise ValueError(
            f"reserve ({_gib(reserve_bytes)}) must be smaller than memory ({_gib(memory_bytes)}): nothing would be "
            "left for the weights and the KV cache"
        )
    budget = memory_bytes - weights["bytes"] - reserve_bytes
    states = state_bytes(config, dtype, tp)

    def need(spec: str, tokens: int, rows: int) -> int:
        stored = kv_bytes(spec, config, tokens, rows, dtype, tp=tp)
        return stored + rows * states + _scratch(spec, config, tokens, rows, dtype, tp, attn)

    rows = []
    for spec in caches:
        stored = kv_bytes(spec, config, context, batch, dtype, tp=tp)
        scratch = _scratch(spec, config, context, batch, dtype, tp, attn)
        longest_need = need(spec, max_context, batch)
        bounded = longest_need == need(spec, max_context // 2, batch)
        if bounded and longest_need <= budget:
            longest = None
        else:
            longest = max(0, _largest(lambda n, s=spec: need(s, n, batch) <= budget, 1, max_context))
        widest = max(0, _largest(lambda b, s=spec: need(s, context, b) <= budget, 1, 2**20))
        fits = stored + batch * states + scratch <= budget
        rows.append(PlanRow(spec, stored / (batch * context), stored, scratch, fits, longest, widest))
    assumptions = [
        f"weights: {weights['parameters']:,} parameters from the config"
        + (
            f", {weights_bits}-bit bitsandbytes on the decoder's linear layers (embeddings, norms, head in "
            f"{str(dtype).removeprefix('torch.')})"
            if weights_bits in (4, 8)
            else f" in {str(dtype).removeprefix('torch.')}"
        ),
        f"reserve: {_gib(reserve_bytes)} for the CUDA context, prefill activations, logits and fragmentation "
        "(chunk long prompts with prefill_chunk_size; measure yours with `hf-kvcache bench`)",
        "KV bytes: what each cache stores (its nbytes) for every row at the full context; no left padding",
        *(
            [
                f"recurrent states: {_mib(states)} per row (the model's Mamba / DeltaNet / convolution layers, kept "
                "as DynamicCache keeps them by every cache), counted in fits, max context and max batch"
            ]
            if states
            else []
        ),
        *(
            [
                f"tensor parallel: one rank of {tp}: 1/{tp} of every layer's KV heads (exact) and of the weights "
                "(approximate: the model's tp_plan decides which weights are sharded)"
            ]
            if tp > 1
            else []
        ),
        f"decode scratch, for {attn} attention: "
        + (
            "none (the quantized caches read their codes in place)"
            if attn == ATTENTION
            else "int8/fp8/int4/int3/int2 dequantize one layer's history per step into a shared workspace (counted); "
            "under attn_implementation='hf_kvcache' they read their codes in place and need none"
        ),
        "paged:share=N: groups of N rows share one prompt (sampling, beams) and each generates 256 tokens",
        *(f"not planned: {spec} ({reason})" for spec, reason in skipped.items()),
        "growth headroom: our caches grow their buffers by 12.5%; DynamicCache's torch.cat briefly holds two "
        "copies of one layer; both fit in the reserve at typical sizes",
    ]
    return MemoryPlan(
        name,
        memory_bytes,
        weights["bytes"],
        reserve_bytes,
        budget,
        states,
        context,
        batch,
        str(dtype).removeprefix("torch."),
        weights_bits,
        rows,
        assumptions,
    )


def _load_config(config):
    """A ``PretrainedConfig`` from a config, a model, a folder, a ``config.json`` path or a hub id."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if not isinstance(config, (str, Path)):
        return resolve_config(config)
    path = Path(config)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"--model: {path} is not a JSON config file ({err})") from err
        if not isinstance(data, dict):
            raise ValueError(f"--model: {path} is not a config (a JSON object with model_type)")
        model_type_name = data.pop("model_type", None)
        if model_type_name is None:
            raise ValueError(f"--model: {path} has no model_type; give the model's config.json")
        return AutoConfig.for_model(model_type_name, **data)
    try:
        return AutoConfig.from_pretrained(str(config))
    except OSError as err:
        raise ValueError(
            f"--model: cannot read a config from {config!r} (a local folder, a config.json or a hub id; offline, "
            f"only local files work): {str(err).splitlines()[0]}"
        ) from err
