"""Stage ``generate``: ``model.generate()`` end to end on Llama-3-8B's architecture with random bfloat16 weights
built on the GPU (nothing downloaded), every cache under sdpa and under the ``hf_kvcache`` attention.

* **decode**: per (context, batch), each cache is filled with the context's K/V (random, written as a chunked
  prefill stores them: the prompt's compute is not repeated per cache, and no prefill scratch is held), then
  ``generate()`` continues from it for :data:`NEW_TOKENS` tokens (its first step reads the filled cache like any
  decode step). Every step is timed as it happens (synchronized); the rate leaves out the first
  :data:`WARM_STEPS` steps (kernel compilation, allocator growth). Peak memory: ``max_memory_allocated`` over the
  decode alone (reset after the fill) and over fill + decode; beside it the weights' and the cache's bytes.
* **largest batch** at 32k tokens: the most rows whose filled cache decodes :data:`FIT_STEPS` steps without running
  out of device memory, found by running around ``hf-kvcache plan``'s answer for the device's memory and that
  attention (the fill's transient is one 2,048-token chunk; a real prefill's activations are what plan's reserve
  stands for).
* **TTFT**: a real prefill through each cache (``generate`` of one token from a random prompt), synchronized.
* **where a step's time goes** (``profile`` in a decode item, the first cell, :data:`PROFILED` runs): the same
  cache continued :data:`PROFILE_STEPS` more steps under ``torch.profiler``: the kernels' summed time per step
  against the step's wall time (their ratio is how busy the device is: a low one means the host issues the step
  slower than the device runs it), launches per step, and the kernels that take most of it. One layer's attention
  takes 0.2-0.8 ms of device time at 32k x 8 (stage ``kernels``) where a 32-layer step took 70-90 ms.

Cells in order of the targets (32k x 8 decode first), each skipped once the stage's time box runs out.
"""

from __future__ import annotations

import gc
import time

import torch
from transformers import LlamaForCausalLM, StoppingCriteriaList

from ..._compat import with_cache
from ...compare import StepClock
from ...memory import cache_nbytes, model_nbytes
from ...prefill import write_tokens
from ...registry import make_cache
from .record import StageRecord
from .shapes import cache_kinds, model_config

__all__ = ["headline", "run"]

NEW_TOKENS = 24
FILL_CHUNK = 2048
WARM_STEPS = 4
FIT_STEPS = 4
FIT_CONTEXT = 32768
DECODE_CELLS = ((32768, 8), (8192, 1), (8192, 8), (32768, 1))
TTFT_CELLS = ((8192, 1), (32768, 1), (32768, 8))
PROFILED = {("dynamic", "sdpa"), ("int8", "hf_kvcache"), ("int4", "hf_kvcache"), ("int2", "hf_kvcache"),
            ("paged", "hf_kvcache")}  # fmt: skip
PROFILE_STEPS = 3
PROFILE_TOP = 6  # kernels named per profile
WARM_CONTEXT = 512  # the warm-up's context: every segment of every kind present (sinks, codes, residual)
# --smoke: every cache and measure once at tiny shapes (the largest batch for two caches only: a search per cache)
SMOKE = {
    "decode": ((200, 2),),
    "ttft": ((96, 1),),
    "fit_context": 160,
    "new_tokens": 6,
    "warm": 2,
    "warm_context": 200,
    "fit_caches": ("dynamic", "int4"),
}


def _runs() -> list[tuple[str, str, str]]:
    """``(label, spec, attn)``: DynamicCache under sdpa (the baseline), each of our caches under both."""
    runs = [("dynamic", "dynamic", "sdpa")]
    for label, spec in cache_kinds().items():
        runs += [(label, spec, "sdpa"), (label, spec, "hf_kvcache")]
    return runs


def build_model(config, device: torch.device, dtype: torch.dtype):
    """The model with random weights, created on ``device`` in ``dtype`` (no float32 copy on the way)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def fill(model, spec: str, batch: int, context: int, gen: torch.Generator):
    """A ``spec`` cache holding ``context`` random tokens per row, written as a chunked prefill stores them
    (:data:`FILL_CHUNK` tokens at a time, every layer in order per chunk; :func:`~hf_kvcache.prefill.write_tokens`:
    no attention read, so no scratch): the transient is one chunk. One random chunk serves every chunk and layer
    (every cache copies or encodes what it is given)."""
    cfg = model.config
    cache = make_cache(spec, model)
    chunk = min(FILL_CHUNK, context)
    shape = (batch, cfg.num_key_value_heads, chunk, cfg.head_dim)
    k = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
    v = torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)
    with torch.inference_mode():
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            for layer in range(cfg.num_hidden_layers):
                write_tokens(cache, layer, k[:, :, :n], v[:, :, :n])
    return cache


def _continue(model, cache, batch: int, context: int, new_tokens: int) -> list[float]:
    """``generate`` from a filled cache; the times at which each token was ready (synchronized)."""
    ids = torch.randint(3, model.config.vocab_size, (batch, context + 1), device=model.device)
    clock = StepClock(model.device)
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
        )  # fmt: skip
    return clock.times


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _step_profile(model, cache, batch: int) -> dict:
    """``PROFILE_STEPS`` more decode steps of ``cache`` under the profiler: wall and kernel time per step (on CPU,
    where the smoke test runs, the operators' time stands for the kernels'), launches, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    device = model.device
    cuda = device.type == "cuda"
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        times = _continue(model, cache, batch, cache.get_seq_length(), PROFILE_STEPS + 1)
    events = [e for e in prof.events() if e.device_type == kind and (cuda or e.cpu_parent is None)]
    steps = len(times) - 1
    wall = times[-1] - times[0]
    per_name: dict[str, float] = {}
    for e in events:
        time_us = e.device_time if cuda else e.cpu_time
        per_name[e.name] = per_name.get(e.name, 0.0) + time_us
    total_us = sum(per_name.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:PROFILE_TOP]
    return {"activity": "cuda" if cuda else "cpu", "steps": steps + 1, "wall_ms_per_step": 1e3 * wall / steps,
            "kernel_ms_per_step": total_us / 1e3 / (steps + 1), "launches_per_step": len(events) / (steps + 1),
            "top": [{"name": name[:80], "ms_per_step": us / 1e3 / (steps + 1), "share": us / total_us}
                    for name, us in top]}  # fmt: skip


def _decode_cell(model, label, spec, attn, context, batch, new_tokens, warm, gen, profiled=False) -> dict:
    device = model.device
    model.set_attn_implementation(attn)
    _free(device)
    _reset_peak(device)
    cache = fill(model, spec, batch, context, gen)
    fill_peak = _peak(device)
    _reset_peak(device)
    times = _continue(model, cache, batch, context, new_tokens)
    decode_peak = _peak(device)
    steps = times[warm:]
    step_s = sorted(b - a for a, b in zip(steps, steps[1:]))
    extra = {"profile": _step_profile(model, cache, batch)} if profiled else {}
    return extra | {
        "measure": "decode", "cache": label, "spec": spec, "attn": attn, "context": context, "batch": batch,
        "decode_tokens_per_s": batch * (len(steps) - 1) / (steps[-1] - steps[0]),
        "step_ms_median": 1e3 * step_s[len(step_s) // 2], "step_ms_min": 1e3 * step_s[0],
        "step_ms_max": 1e3 * step_s[-1], "timed_steps": len(steps) - 1, "cache_bytes": cache_nbytes(cache),
        "weights_bytes": model_nbytes(model), "decode_peak_bytes": decode_peak, "fill_peak_bytes": fill_peak,
    }  # fmt: skip


def _fits(model, spec: str, batch: int, context: int, memory: int, gen) -> bool:
    """Whether ``batch`` rows of ``context`` tokens fill a ``spec`` cache and decode :data:`FIT_STEPS` steps within
    ``memory`` bytes: on CUDA, without running out of device memory; elsewhere, with the weights plus the peak of the
    tensors created (:class:`~hf_kvcache.memory.PeakTensorBytes`) within ``memory``."""
    from ...memory import PeakTensorBytes

    device = model.device
    _free(device)
    fits = True
    try:
        if device.type == "cuda":
            _continue(model, fill(model, spec, batch, context, gen), batch, context, FIT_STEPS)
        else:
            with PeakTensorBytes() as tracker:
                _continue(model, fill(model, spec, batch, context, gen), batch, context, FIT_STEPS)
            fits = model_nbytes(model) + tracker.peak_bytes <= memory
    except torch.cuda.OutOfMemoryError:
        fits = False
    _free(device)  # after the handler: the failed attempt's tensors went with its traceback
    return fits


def _largest_batch(model, label, spec, attn, context, gen, has_time) -> dict:
    """The most rows that fit, searched around the plan's answer: up or down by about 10% (doubling the step) until
    the answer flips, then bisected to one row (or until the time box ends: ``exact`` is then False, and
    ``largest_batch`` None if no batch was found to fit)."""
    from ...plan import plan_memory

    device = model.device
    if device.type == "cuda":
        memory, reserve = torch.cuda.get_device_properties(device).total_memory, None
    else:  # the smoke run: a small budget above the weights, no reserve for a CUDA context
        memory, reserve = model_nbytes(model) + 2**23, 2**20
    plan = plan_memory(model.config, memory, context=context, caches=(spec,), dtype=model.dtype, reserve=reserve,
                       attn=attn)  # fmt: skip
    planned = max(plan.rows[0].max_batch, 1)
    cap = 4 * planned + 16
    model.set_attn_implementation(attn)
    tried: dict[int, bool] = {}
    started = time.monotonic()

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = _fits(model, spec, b, context, memory, gen)
        return tried[b]

    step = max(1, planned // 10)
    if fits(planned):
        low, high = planned, None
        while high is None and low < cap and has_time():
            low, high = (low + step, None) if fits(low + step) else (low, low + step)
            step *= 2
    else:
        low, high = 0, planned
        while low == 0 and high > 1 and has_time():
            probe = max(high - step, 1)
            low, high = (probe, high) if fits(probe) else (0, probe)
            step *= 2
    while high is not None and high - low > 1 and has_time():
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return {
        "measure": "largest batch", "cache": label, "spec": spec, "attn": attn, "context": context,
        "largest_batch": low if low or high == 1 else None, "exact": high is not None and high - low == 1,
        "planned_batch": planned,
        "memory_bytes": memory, "plan_reserve_bytes": plan.reserve_bytes, "tried": tried,
        "seconds": time.monotonic() - started,
    }  # fmt: skip


def _ttft(model, label, spec, attn, context, batch, gen) -> dict:
    device = model.device
    model.set_attn_implementation(attn)
    _free(device)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen, device=device)
    cache = make_cache(spec, model)
    _reset_peak(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=1,
                       do_sample=False)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "measure": "ttft", "cache": label, "spec": spec, "attn": attn, "context": context, "batch": batch,
        "ttft_s": time.perf_counter() - start, "peak_bytes": _peak(device), "cache_bytes": cache_nbytes(cache),
    }  # fmt: skip


def _attempt(record: StageRecord, what: str, fn, *args, keep: bool = True) -> None:
    """One item; running out of memory or any error is recorded and the stage goes on."""
    try:
        item = fn(*args)
        if keep:
            record.add(item)
    except Exception as err:
        record.error(what, err)
    finally:
        _free(torch.device(record.info["device"]))


def run(record: StageRecord, device: str, smoke: bool) -> None:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = model_config(smoke)
    started = time.monotonic()
    model = build_model(config, dev, dtype)
    record.info |= {"model": "smoke Llama" if smoke else "Llama-3-8B architecture, random weights",
                    "layers": config.num_hidden_layers, "dtype": str(dtype), "weights_bytes": model_nbytes(model),
                    "build_s": time.monotonic() - started}  # fmt: skip
    record.save()
    # Every object alive now (the libraries, the model) is left out of the collections between items, which free each
    # item's caches (reference cycles through hooks): a full collection walked them all, 0.54 s each on CPU, 51 s of
    # the smoke run's 56 s in-process, and as much per item of a lent GPU's box.
    gc.freeze()
    try:
        _measure(record, model, dev, smoke)
    finally:
        gc.unfreeze()


def _measure(record: StageRecord, model, dev: torch.device, smoke: bool) -> None:
    gen = torch.Generator(device=dev).manual_seed(0)
    new_tokens, warm = (SMOKE["new_tokens"], SMOKE["warm"]) if smoke else (NEW_TOKENS, WARM_STEPS)
    decode_cells = SMOKE["decode"] if smoke else DECODE_CELLS
    fit_context = SMOKE["fit_context"] if smoke else FIT_CONTEXT
    warm_context = SMOKE["warm_context"] if smoke else WARM_CONTEXT
    runs = _runs()
    for label, spec, attn in runs:  # every kernel variant compiled once, outside the timings
        if record.has_time(3) and not smoke:
            _attempt(record, f"warm-up {label} [{attn}]", _decode_cell, model, label, spec, attn, warm_context, 2,
                     warm + 2, warm, gen, keep=False)  # fmt: skip
    plan = [("decode", decode_cells[0]), ("largest batch", (fit_context, None))]
    plan += [("ttft", cell) for cell in (SMOKE["ttft"] if smoke else TTFT_CELLS[:2])]
    plan += [("decode", cell) for cell in decode_cells[1:]]
    plan += [] if smoke else [("ttft", TTFT_CELLS[2])]
    for measure, (context, batch) in plan:
        for label, spec, attn in runs:
            if measure != "decode" and attn == "sdpa" and label != "dynamic":
                continue  # a prefill is sdpa's under either attention; the largest batch is ours under hf_kvcache
            what = f"{measure} {label} [{attn}] {context}" + (f" x {batch}" if batch else "")
            if record.out_of_time(what, 3):
                continue
            if measure == "decode":
                profiled = (context, batch) == decode_cells[0] and (label, attn) in PROFILED
                _attempt(record, what, _decode_cell, model, label, spec, attn, context, batch, new_tokens, warm, gen,
                         profiled)  # fmt: skip
            elif measure == "ttft":
                _attempt(record, what, _ttft, model, label, spec, attn, context, batch, gen)
            elif smoke and label not in SMOKE["fit_caches"]:
                continue
            else:
                _attempt(record, what, _largest_batch, model, label, spec, attn, context, gen,
                         lambda: record.has_time(10))  # fmt: skip


def headline(record: dict) -> list[str]:
    info = record.get("info", {})
    lines = [f"{info.get('model')}, {info.get('layers')} layers, {info.get('dtype')}"]
    items = record.get("items", [])
    base = {(i["context"], i["batch"]): i["decode_tokens_per_s"] for i in items
            if i["measure"] == "decode" and i["cache"] == "dynamic"}  # fmt: skip
    for i in items:
        if i["measure"] == "decode":
            ref = base.get((i["context"], i["batch"]))
            ratio = f" = {i['decode_tokens_per_s'] / ref:.2f}x dynamic" if ref else ""
            lines.append(f"decode {i['context']} x {i['batch']} {i['cache']} [{i['attn']}]: "
                         f"{i['decode_tokens_per_s']:.0f} tok/s{ratio}")  # fmt: skip
        elif i["measure"] == "largest batch":
            found = "not found" if i["largest_batch"] is None else i["largest_batch"]
            lines.append(f"largest batch at {i['context']}: {i['cache']} [{i['attn']}] {found} "
                         f"(plan {i['planned_batch']})")  # fmt: skip
        elif i["measure"] == "ttft":
            lines.append(f"ttft {i['context']} x {i['batch']} {i['cache']} [{i['attn']}]: {i['ttft_s']:.3f} s")
    return lines
