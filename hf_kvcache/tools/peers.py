"""transformers' built-in caches versus hf_kvcache, checked live: prints a markdown table of what actually happened.

Each row runs one behaviour on tiny seeded random models (CPU, a few seconds each) through transformers'
``QuantizedCache`` (backends quanto and hqq at 4 bits, hqq at 8 bits, fp8) and through ``QuantizedKVCache`` (int4,
int8), and reports the outcome as it came: the exception raised (type, message, and the function that raised it),
or "works" and how the greedy tokens compare with ``DynamicCache``'s. Where the built-in works, the table says so.
The last two rows compare ``SlidingWindowKVCache`` and ``PagedKVCache`` with what transformers offers instead.

Random-weight models have near-tied logits, so a token that differs from ``DynamicCache`` after a few steps is a weak
accuracy signal; the teacher-forced logit-error row is the steadier one. ``tests/test_builtin_comparison.py`` asserts
the differences this table shows, so CI notices when a transformers release changes one.

    python benchmarks/compare_builtin.py
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import traceback
import warnings
from collections.abc import Callable
from functools import cache
from importlib.metadata import PackageNotFoundError, version

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from hf_kvcache import PagedKVCache, QuantizedKVCache, SlidingWindowKVCache
from hf_kvcache._compat import with_cache
from hf_kvcache.tools.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_llama

# The behaviour rows: head_dim 16, so one quantization group of 16 spans a head; a residual of 16 tokens fills
# (and, in the built-in, flushes) several times within a short generation.
GROUP, RESIDUAL = 16, 16
# The accuracy rows: tiny_llama (head_dim 64, 4 layers), a 64-token prompt and 64 new tokens, so tokens leave the
# residual of 32 during the prompt and again during generation.
ACC_GROUP, ACC_RESIDUAL, ACC_PROMPT, ACC_NEW = 32, 32, 64, 64

VOCAB = TINY_VOCAB
CONFIGS = TINY_FAMILIES  # the test matrix's tiny configs (tests/models.py)

Factory = Callable[[torch.nn.Module], Cache]


# -- models, inputs, generation --------------------------------------------------------------------------------------


@cache
def small_model(family: str = "llama", seed: int = 0):
    """A seeded random model of ``family``; ``seed=1`` gives an assistant that disagrees with ``seed=0``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always generate the full length, so outputs line up
    return model


@cache
def accuracy_model():
    return tiny_llama(head_dim=64, layers=4, seed=0)


def make_inputs(rows: int = 1, length: int = 12, vocab: int = VOCAB, pad: int = 0, seed: int = 1) -> dict:
    """Random prompts; ``pad`` left-pads every row after the first by that many tokens."""
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1:, :pad], mask[1:, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def repetitive_inputs() -> dict:
    """A prompt that repeats itself, so prompt-lookup decoding finds n-grams to propose (and later crops)."""
    part = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ids = part.repeat(1, 3)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, inputs: dict, cache: Cache | None, new_tokens: int, **kwargs) -> torch.Tensor:
    kwargs.setdefault("do_sample", False)
    with torch.inference_mode():
        return model.generate(**inputs, **with_cache(model, cache), max_new_tokens=new_tokens, **kwargs)


def compare_tokens(out: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> str:
    """'works, equal to DynamicCache' or the first generated token (counting from 1) that differs in any row."""
    new = ref.shape[1] - prompt_len
    if out.shape != ref.shape:
        return f"works, but shape {tuple(out.shape)} != DynamicCache's {tuple(ref.shape)}"
    diff = (out[:, prompt_len:] != ref[:, prompt_len:]).any(0).nonzero()
    if not len(diff):
        return f"works, equal to DynamicCache ({new} new tokens)"
    return f"works, first differs from DynamicCache at new token {int(diff[0]) + 1} of {new}"


def describe_error(err: BaseException) -> str:
    """``Type: message (in `function`, file)``: the innermost frame, the message's first line, cut to 150 chars."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if len(message) > 150:
        message = message[:147] + "..."
    return f"{type(err).__name__}: {message} (in `{frame.name}`, {os.path.basename(frame.filename)})"


# -- subjects ---------------------------------------------------------------------------------------------------------


def builtin_subjects(group: int = GROUP, residual: int = RESIDUAL) -> dict[str, Factory]:
    """transformers' ``QuantizedCache`` with each backend; an unavailable one fails at construction, reported."""

    def grouped(backend, nbits):
        return lambda model: QuantizedCache(
            backend=backend, config=model.config, nbits=nbits, q_group_size=group, residual_length=residual
        )

    return {
        "quanto 4": grouped("quanto", 4),
        "hqq 4": grouped("hqq", 4),
        "hqq 8": grouped("hqq", 8),
        # fp8 takes no group-wise options (it raises if given any): per-tensor scale, no residual.
        "fp8": lambda model: QuantizedCache(backend="fp8", config=model.config),
    }


def our_subjects(group: int = GROUP, residual: int = RESIDUAL) -> dict[str, Factory]:
    """``QuantizedKVCache`` at 4 bits (same group and residual as the built-in) and at 8 bits (its defaults)."""
    return {
        "int4": lambda model: QuantizedKVCache(model, bits=4, group_size=group, residual_length=residual),
        "int8": lambda model: QuantizedKVCache(model, bits=8),
    }


def matched_int8(group: int = ACC_GROUP, residual: int = ACC_RESIDUAL) -> Factory:
    """int8 with the built-in hqq 8's group size and residual, for an accuracy comparison at equal settings."""
    return lambda model: QuantizedKVCache(model, bits=8, group_size=group, residual_length=residual)


def attempt(probe: Callable[[Factory], str], factory: Factory) -> str:
    try:
        return probe(factory)
    except Exception as err:  # the outcome being reported, whatever it is
        return describe_error(err)


def cell(probe: Callable[[Factory], str], subjects: dict[str, Factory] | str) -> str:
    """One table cell: subjects with the same outcome share a line; a string is the cell as it stands."""
    if isinstance(subjects, str):
        return subjects
    outcomes: dict[str, list[str]] = {}
    for label, factory in subjects.items():
        outcomes.setdefault(attempt(probe, factory), []).append(label)
    return "<br>".join(f"**{', '.join(labels)}**: {text}" for text, labels in outcomes.items())


# -- probes: each takes a cache factory and returns what happened ----------------------------------------------------


def probe_generate(family: str, new_tokens: int = 40) -> Callable[[Factory], str]:
    """Construct the cache for ``family`` and generate greedily; compare with DynamicCache."""

    def probe(factory):
        model, inputs = small_model(family), make_inputs()
        ref = generate(model, inputs, DynamicCache(config=model.config), new_tokens)
        return compare_tokens(generate(model, inputs, factory(model), new_tokens), ref, inputs["input_ids"].shape[1])

    return probe


def probe_padded_batch(factory):
    model, inputs = small_model(), make_inputs(rows=2, pad=5)
    ref = generate(model, inputs, DynamicCache(config=model.config), 24)
    return compare_tokens(generate(model, inputs, factory(model), 24), ref, 12)


def probe_speculative(mode: str) -> Callable[[Factory], str]:
    """Prompt-lookup or assisted decoding (both ``crop()`` the cache after rejected candidates), vs plain greedy."""

    def probe(factory):
        model, inputs = small_model(), repetitive_inputs()
        kwargs = {"prompt_lookup_num_tokens": 3} if mode == "lookup" else {"assistant_model": small_model(seed=1)}
        ref = generate(model, inputs, DynamicCache(config=model.config), 24)
        cache = factory(model)
        crops = []
        crop = cache.crop
        cache.crop = lambda n: crops.append(n) or crop(n)  # count the crops that actually remove tokens
        out = generate(model, inputs, cache, 24, **kwargs)
        removing = sum(1 for n in crops if n)
        calls = "call" if removing == 1 else "calls"
        return f"{compare_tokens(out, ref, inputs['input_ids'].shape[1])}; {removing} crop() {calls} removed tokens"

    return probe


def random_kv(model, tokens: int, rows: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random keys and values shaped for one layer of ``model``: ``(rows, kv_heads, tokens, head_dim)``."""
    config = model.config
    shape = (rows, config.num_key_value_heads, tokens, config.hidden_size // config.num_attention_heads)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def crop_observables(cache: Cache, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Layer 0: prefill 20 tokens, decode 3, ``crop(-2)``, decode 1. Returns (length before crop, after crop,
    kv length the next step's mask is built for, keys the next update returns)."""
    cache.update(k[:, :, :20], v[:, :, :20], 0)
    for t in range(20, 23):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    before = cache.get_seq_length()
    cache.crop(-2)
    after = cache.get_seq_length()
    mask_len = cache.get_mask_sizes(1, 0)[0]
    keys, _ = cache.update(k[:, :, 23:24], v[:, :, 23:24], 0)
    return before, after, mask_len, keys.shape[-2]


def probe_crop(factory):
    model = small_model()
    k, v = random_kv(model, 24)
    ref = crop_observables(DynamicCache(config=model.config), k, v)
    got = crop_observables(factory(model), k, v)
    if got == ref:
        return f"works, as DynamicCache: length {got[0]} -> {got[1]}, next step attends {got[3]} keys"
    return (
        f"silently inconsistent: length {got[0]} -> {got[1]} (DynamicCache: {ref[1]}); next step's mask covers "
        f"{got[2]} keys but update returns {got[3]} (DynamicCache: {ref[2]} and {ref[3]})"
    )


def probe_beam(factory):
    model, inputs = small_model(), make_inputs(rows=2, pad=5)
    ref = generate(model, inputs, DynamicCache(config=model.config), 24, num_beams=3)
    return compare_tokens(generate(model, inputs, factory(model), 24, num_beams=3), ref, 12)


def without_quantization(factory: Factory) -> Factory:
    """The built-in's grouped layers with ``_quantize`` / ``_dequantize`` replaced by identity: its bookkeeping
    (residual, flushes, deferred beam reordering, crop) runs unchanged, minus the rounding error."""

    def make(model):
        cache = factory(model)
        for layer in cache.layers:
            layer._quantize = lambda tensor, *args, **kwargs: tensor.clone()
            layer._dequantize = lambda stored: stored
        return cache

    return make


def probe_sampling(factory):
    model, inputs = small_model(), make_inputs(rows=2, pad=5)
    kwargs = dict(do_sample=True, num_return_sequences=3)
    torch.manual_seed(0)
    ref = generate(model, inputs, DynamicCache(config=model.config), 24, **kwargs)
    torch.manual_seed(0)  # same draws, so any difference comes from the cache
    out = generate(model, inputs, factory(model), 24, **kwargs)
    return compare_tokens(out, ref, 12) + f" (output {tuple(out.shape)}, seed 0)"


def probe_continuation(factory):
    model, inputs = small_model(), make_inputs()
    ref = generate(model, inputs, DynamicCache(config=model.config), 24)
    cache = factory(model)
    first = generate(model, inputs, cache, 12)
    out = generate(model, {"input_ids": first, "attention_mask": torch.ones_like(first)}, cache, 12)
    return compare_tokens(out, ref, 12) + f" (12 + 12 new tokens, one cache; {cache.get_seq_length()} cached)"


def full_precision_tokens(layer) -> int:
    """Tokens a layer holds unquantized: ours in ``residual``; the built-in in ``keys`` (1-D and empty when none)."""
    if hasattr(layer, "residual"):
        return layer.residual.length
    return layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0


def probe_prompt_precision(factory):
    model, inputs = small_model(), make_inputs()
    cache = factory(model)
    with torch.inference_mode():
        model(**inputs, **with_cache(model, cache), use_cache=True)
    n = inputs["input_ids"].shape[1]
    return f"{full_precision_tokens(cache.layers[0])} of the {n} prompt tokens kept in full precision"


def count_quantized(cache: Cache) -> list[tuple[int, int]]:
    """Patch layer 0's quantizer to record ``(first position, tokens)`` of every key tensor it is handed."""
    layer, calls = cache.layers[0], []
    if hasattr(layer, "codec"):  # ours: the codec gets the oldest residual tokens, once each
        # int8 encodes straight into the storage (encode_into); KIVI encodes a chunk the storage then appends
        name = "encode_into" if hasattr(layer.codec, "encode_into") else "encode"
        encode = getattr(layer.codec, name)

        def recording_encode(k, v, *out):
            calls.append((layer.quantized_tokens, k.shape[-2]))
            return encode(k, v, *out)

        setattr(layer.codec, name, recording_encode)
    else:  # built-in: _quantize(tensor, ...) once for keys, once for values, after cumulative_length is updated
        quantize, seen = layer._quantize, []

        def recording_quantize(tensor, *args, **kwargs):
            seen.append(None)
            if len(seen) % 2:  # keys; the values call that follows has the same tokens
                n = tensor.shape[-2]
                calls.append((layer.cumulative_length - n, n))
            return quantize(tensor, *args, **kwargs)

        layer._quantize = recording_quantize
    return calls


def probe_requantization(factory):
    model, inputs = small_model(), make_inputs()
    cache = factory(model)
    calls = count_quantized(cache)
    generate(model, inputs, cache, 64)
    cached = cache.get_seq_length()
    first = sum(1 for start, _ in calls if start == 0)
    total = sum(n for _, n in calls)
    times = "once" if first == 1 else f"{first} times"
    return (
        f"first token quantized {times}; {total} token quantizations for {cached} cached tokens "
        f"({total / cached:.2f} per token, {full_precision_tokens(cache.layers[0])} still in full precision)"
    )


def row0_error(factory: Factory, model) -> float:
    """Largest difference in row 0's keys after a flush: cached alone vs in a batch of 3. Beams and batch rows
    should not interact."""
    k, v = random_kv(model, 21, rows=3)
    # Rows of different scale, as different prompts give: a per-tensor scale then depends on the other rows.
    k[1], v[1] = 3 * k[1], 3 * v[1]
    alone, batched = factory(model), factory(model)
    alone.update(k[:1, :, :20], v[:1, :, :20], 0)
    batched.update(k[:, :, :20], v[:, :, :20], 0)
    ka, _ = alone.update(k[:1, :, 20:], v[:1, :, 20:], 0)
    kb, _ = batched.update(k[:, :, 20:], v[:, :, 20:], 0)
    return (ka[0] - kb[0]).abs().max().item()


def probe_row_independence(factory):
    err = row0_error(factory, small_model())
    if err == 0:
        return "row 0 identical alone or in a batch of 3"
    return f"row 0 differs by up to {err:.3f} when batched with 2 other rows"


def accuracy_inputs() -> dict:
    return make_inputs(length=ACC_PROMPT, vocab=accuracy_model().config.vocab_size, seed=0)


@cache
def accuracy_reference() -> torch.Tensor:
    model = accuracy_model()
    return generate(model, accuracy_inputs(), DynamicCache(config=model.config), ACC_NEW)


def probe_divergence(factory):
    model = accuracy_model()
    return compare_tokens(generate(model, accuracy_inputs(), factory(model), ACC_NEW), accuracy_reference(), ACC_PROMPT)


def teacher_forced_logits(model, ids: torch.Tensor, cache: Cache, prompt: int) -> torch.Tensor:
    """Logits of every position after the prompt, one token per forward, through ``cache``."""
    steps = []
    with torch.inference_mode():
        out = model(input_ids=ids[:, :prompt], **with_cache(model, cache), use_cache=True)
        steps.append(out.logits[:, -1])
        for t in range(prompt, ids.shape[1] - 1):
            steps.append(model(input_ids=ids[:, t : t + 1], **with_cache(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(steps, 1)


def probe_logit_error(factory):
    model, ids = accuracy_model(), accuracy_reference()
    ref = teacher_forced_logits(model, ids, DynamicCache(config=model.config), ACC_PROMPT)
    err = (teacher_forced_logits(model, ids, factory(model), ACC_PROMPT) - ref).abs()
    return f"max {err.max().item():.4f}, mean {err.mean().item():.5f} (logit std {ref.std().item():.3f})"


# -- the rows that are not about QuantizedCache -----------------------------------------------------------------------


def builtin_sink_cell() -> str:
    parts = [
        f"`transformers.SinkCache` exists: {hasattr(transformers, 'SinkCache')}",
        f"`transformers.cache_utils.SinkCache` exists: {hasattr(transformers.cache_utils, 'SinkCache')}",
    ]
    model, inputs = small_model(), make_inputs()
    try:
        generate(model, inputs, None, 4, cache_implementation="sink")
        parts.append("`generate(cache_implementation='sink')` works")
    except Exception as err:
        parts.append(f"`generate(cache_implementation='sink')`: {describe_error(err)}")
    return "<br>".join(parts)


def our_sink_cell() -> str:
    model, inputs = small_model(), make_inputs()
    cache = SlidingWindowKVCache(model, window=16, sinks=4)
    try:
        out = generate(model, inputs, cache, 64)
    except Exception as err:
        return f"`SlidingWindowKVCache(window=16, sinks=4)`: {describe_error(err)}"
    return (
        f"`SlidingWindowKVCache(window=16, sinks=4)` works: {out.shape[1] - 12} new tokens, "
        f"{cache.get_seq_length()} seen, {cache.layers[0].stored_tokens} stored in layer 0"
    )


def builtin_paged_cell() -> str:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    parts = [f"`PagedAttentionCache` is a `Cache` subclass: {issubclass(PagedAttentionCache, Cache)}"]
    model, inputs = small_model(), make_inputs()
    cb_config = ContinuousBatchingConfig(
        page_size=16, num_blocks=16, max_batch_tokens=64, max_memory_percent=0.1, use_cuda_graph=False
    )
    try:
        paged = PagedAttentionCache(model.config, cb_config, "cpu", DistributedHelper(None, None), dtype=torch.float32)
        generate(model, inputs, paged, 8)
        parts.append("`generate(past_key_values=PagedAttentionCache(...))` works")
    except Exception as err:
        parts.append(f"`generate(past_key_values=PagedAttentionCache(...))`: {describe_error(err)}")
    # Its supported route: continuous batching. generate_batch edits the generation config it is given, so a copy.
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.max_new_tokens, gen_config.do_sample = 8, False
    try:
        ref = generate(model, inputs, DynamicCache(config=model.config), 8)[0, 12:].tolist()
        out = model.generate_batch(
            [inputs["input_ids"][0].tolist()], generation_config=gen_config, continuous_batching_config=cb_config
        )
        tokens = next(iter(out.values())).generated_tokens
        same = "equal to" if tokens == ref else "differs from"
        parts.append(f"`model.generate_batch()` (continuous batching) works, {same} DynamicCache (8 new tokens)")
    except Exception as err:
        parts.append(f"`model.generate_batch()`: {describe_error(err)}")
    return "<br>".join(parts)


def our_paged_cell() -> str:
    model, inputs = small_model(), make_inputs(rows=2, pad=5)
    ref = generate(model, inputs, DynamicCache(config=model.config), 24)
    cache = PagedKVCache(model, block_size=4)
    try:
        result = compare_tokens(generate(model, inputs, cache, 24), ref, 12)
    except Exception as err:
        result = describe_error(err)
    return f"`PagedKVCache` is a `Cache` subclass: {isinstance(cache, Cache)}<br>`generate()`: {result}"


# -- table ------------------------------------------------------------------------------------------------------------


def rows() -> list[tuple[str, str, str]]:
    """(behaviour, built-in cell, hf_kvcache cell) for every row."""
    builtin, ours = builtin_subjects(), our_subjects()
    acc_builtin = builtin_subjects(ACC_GROUP, ACC_RESIDUAL)
    acc_ours = our_subjects(ACC_GROUP, ACC_RESIDUAL)
    four = ({k: acc_builtin[k] for k in ("quanto 4", "hqq 4")}, {"int4": acc_ours["int4"]})
    eight = (
        {k: acc_builtin[k] for k in ("hqq 8", "fp8")},
        {"int8": acc_ours["int8"], f"int8 group {ACC_GROUP} residual {ACC_RESIDUAL}": matched_int8()},
    )
    lossless = {k: without_quantization(builtin[k]) for k in ("quanto 4", "hqq 4")}
    table = [
        ("Llama, left-padded batch of 2, greedy", probe_padded_batch, builtin, ours),
        ("Hybrid model: Gemma 3 (sliding + full layers), greedy", probe_generate("gemma3"), builtin, ours),
        ("Hybrid model: Mistral (`sliding_window=12`), greedy", probe_generate("mistral"), builtin, ours),
        ("Prompt-lookup decoding (`prompt_lookup_num_tokens=3`)", probe_speculative("lookup"), builtin, ours),
        ("Assisted decoding (`assistant_model=`)", probe_speculative("assisted"), builtin, ours),
        ("`crop(-2)` after 20 + 3 tokens (layer 0)", probe_crop, builtin, ours),
        ("Beam search (`num_beams=3`), padded batch", probe_beam, builtin, ours),
        ("Beam search as above, quantizer replaced by identity", probe_beam, lossless, "n/a (equal with it, above)"),
        ("Sampling, `num_return_sequences=3`, padded batch", probe_sampling, builtin, ours),
        ("Continuation: `generate()` twice with one cache", probe_continuation, builtin, ours),
        ("Prompt tail in full precision after a 12-token prefill", probe_prompt_precision, builtin, ours),
        ("Re-quantization: layer 0 keys, 12-token prompt + 64 new", probe_requantization, builtin, ours),
        ("Batch rows independent (row 0's keys, alone vs batched)", probe_row_independence, builtin, ours),
        ("4 bits: first greedy token differing from DynamicCache", probe_divergence, *four),
        ("8 bits: first greedy token differing from DynamicCache", probe_divergence, *eight),
        ("4 bits: logit error vs DynamicCache, teacher-forced", probe_logit_error, *four),
        ("8 bits: logit error vs DynamicCache, teacher-forced", probe_logit_error, *eight),
    ]
    out = [(name, cell(probe, b), cell(probe, o)) for name, probe, b, o in table]
    out.append(("Attention sinks (StreamingLLM)", builtin_sink_cell(), our_sink_cell()))
    out.append(("Paged cache through `generate()`", builtin_paged_cell(), our_paged_cell()))
    return out


def format_rows(table: list[tuple[str, str, str]]) -> str:
    lines = ["| behaviour | transformers built-in | hf_kvcache |", "|---|---|---|"]
    lines += [" | ".join(["", *(c.replace("|", "\\|") for c in row), ""]).strip() for row in table]
    return "\n".join(lines)


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # deprecation chatter from generate() would bury the table
    warnings.filterwarnings("ignore")

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, optimum-quanto "
        f"{package_version('optimum-quanto')}, hqq {package_version('hqq')}, {platform.machine()} CPU\n\n"
        f"Built-in: `QuantizedCache(backend, nbits, q_group_size={GROUP}, residual_length={RESIDUAL})`, "
        f"fp8 with its defaults; ours: `QuantizedKVCache(bits=4, group_size={GROUP}, residual_length={RESIDUAL})` "
        f"and `QuantizedKVCache(bits=8)` (residual 0). Accuracy rows: tiny_llama (head_dim 64, 4 layers), "
        f"{ACC_PROMPT}-token prompt, {ACC_NEW} new tokens, group {ACC_GROUP}, residual {ACC_RESIDUAL}. "
        "New tokens are counted from 1.\n"
    )
    print(format_rows(rows()))


if __name__ == "__main__":
    main()
