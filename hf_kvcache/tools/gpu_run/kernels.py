"""Stage ``kernels``: one decode step of one layer's attention at Llama-3-8B's attention shape (32 query / 8 KV heads,
head_dim 128, bfloat16), for every cache kind, against ``scaled_dot_product_attention`` over bfloat16 K/V with the
flash backend (what ``DynamicCache`` + sdpa reads).

Each kind's storage is the real cache's: a one-layer cache of that kind is filled with the context's K/V (random,
one ``update`` as a prefill stores them), then one decode token is passed with the ``hf_kvcache`` attention on, and
the handle the layer returns (its sinks, codes, residual and the new token, views of its storage) is what is timed:
``decode_attention`` over it, every launch of that layer's step (the partials of each segment and their combine).
Bytes read: what the layer stores (``nbytes``) plus the query. Per cell: median time, spread, speed-up over sdpa,
achieved bandwidth, and the memory roofline (bytes / peak bandwidth) as a fraction of the measured time; then the
same step (and sdpa) as one CUDA-graph replay, the device's time alone (``graph_us``, ``graph_speedup_vs_sdpa``,
``graph_of_peak``): the first H200 runs issued a 4k-token step in 240-1,500 µs whose kernels took 13-50 µs, so the
time as issued measures the host, and only the replay measures the kernels.

Order: the 16k x 8 cell for every kind first (the targets' shape), then the others, so a short box still measures it.

Then, where the box has time, **where a step's time goes on the host** (``measure: "host"``) for dense, int8, int3
and KIVI's int2 layout at 4k x 1, the shape where the first GPU runs found every kind 7-35x slower than sdpa: the
host's time to issue one call without waiting for the device (a step is host-bound when that is close to its device
time), the device-to-host syncs it makes, and the Python functions that take the host's time (``cProfile``, top
``HOST_TOP`` by own time).

Last, **launch-plan variants** (``measure: "variant"``, :data:`~.plans.VARIANTS`): a kind's step at 16k x 8 with
its plan as the formats choose it and with each candidate's fields replaced, side by side (issued and device-only
time, and how far the variant's output is from the plan's), so every lent GPU decides the candidates waiting for one.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import torch

from ...formats import DenseSegment, KVHandle, decode_attention
from ...registry import make_cache
from .env import peak_bandwidth
from .plans import VARIANTS, each_plan
from .record import StageRecord
from .shapes import cache_kinds, model_config
from .timing import Timing, bench, graphed

__all__ = ["SHAPES", "headline", "run"]

# (context, batch), the targets' cell first
SHAPES = ((16384, 8), (4096, 1), (65536, 8), (4096, 8), (16384, 1), (65536, 1))
SMOKE_SHAPES = ((400, 2), (256, 1))
HOST_KINDS = ("dense", "int8", "int3", "int2 KIVI layout")  # the host profile's kinds, at the 4k x 1 cell
HOST_CALLS = 50  # calls issued back to back per host measurement
HOST_TOP = 12  # Python functions kept per profile
GRAPH_SECONDS = 0.1  # a replay's time barely varies: a shorter bench than the issued step's


def triton_status() -> tuple[bool, str | None]:
    """Whether the Triton kernels import on this machine, and why not."""
    try:
        from ...kernels import triton_decode  # noqa: F401
    except Exception as err:
        return False, f"{type(err).__name__}: {err}"
    return True, None


def _sdpa(query, k, v, scaling):
    """sdpa over bf16 K/V with GQA, the flash backend forced where torch has it for these inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def plain():
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scaling, enable_gqa=True)

    if query.is_cuda:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                plain()

            def flash():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return plain()

            return flash, "flash"
        except RuntimeError:
            pass
    return plain, "default"


def decode_handle(spec: str, config, k: torch.Tensor, v: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor):
    """``(handle, layer bytes)`` of one decode step of a one-layer ``spec`` cache holding ``k``/``v``."""
    cache = make_cache(spec, config)
    config._attn_implementation = "sdpa"
    cache.update(k, v, 0)  # a prefill: stored as the model's forward stores it
    config._attn_implementation = "hf_kvcache"
    handle, _ = cache.update(k1, v1, 0)
    if not isinstance(handle, KVHandle):
        raise RuntimeError(f"{spec}: the layer returned {type(handle).__name__}, not a storage handle")
    return handle, cache, cache.layers[0].nbytes


def run(record: StageRecord, device: str, smoke: bool) -> None:
    dev = torch.device(device)
    ok, why = triton_status()
    peak, source = peak_bandwidth(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter is wrong for bfloat16
    config = model_config(smoke, layers=1)
    record.info |= {"triton": ok, "triton_error": why, "dtype": str(dtype), "heads": config.num_attention_heads,
                    "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim, "peak_bandwidth": peak,
                    "peak_source": source}  # fmt: skip
    for context, batch in SMOKE_SHAPES if smoke else SHAPES:
        if record.out_of_time(f"{context} x {batch}", 5):
            continue
        _cell(record, config, dev, dtype, context, batch, peak)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    context, batch = SMOKE_SHAPES[1] if smoke else (4096, 1)
    for label in HOST_KINDS:
        if record.out_of_time(f"host {label}", 5):
            continue
        try:
            record.add(_host(config, dev, dtype, context, batch, label))
        except Exception as err:
            record.error(f"host {label}", err)
    context, batch = SMOKE_SHAPES[0] if smoke else SHAPES[0]
    for label, variants in VARIANTS.items():
        if record.out_of_time(f"variants {label}", 10):
            continue
        try:
            for item in _variants(config, dev, dtype, context, batch, label, variants):
                record.add(item)
        except Exception as err:
            record.error(f"variants {label}", err)


def _inputs(config, dev, dtype, context: int, batch: int) -> dict[str, torch.Tensor]:
    """The cell's random K/V (``k``, ``v``), the decode token's (``k1``, ``v1``) and the query."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    g = torch.Generator(device=dev).manual_seed(context + batch)
    out = {}
    for name, h, n in (("k", kv_heads, context), ("v", kv_heads, context), ("k1", kv_heads, 1), ("v1", kv_heads, 1),
                       ("query", heads, 1)):  # fmt: skip
        out[name] = torch.randn((batch, h, n, dim), generator=g, device=dev, dtype=dtype)
    return out


def _host(config, dev, dtype, context: int, batch: int, label: str) -> dict:
    """Where one ``decode_attention`` call's host time goes, for one kind (see the module's docstring)."""
    x = _inputs(config, dev, dtype, context, batch)
    scaling = config.head_dim**-0.5
    if label == "dense":
        kf, vf = torch.cat([x["k"], x["k1"]], 2), torch.cat([x["v"], x["v1"]], 2)
        handle = KVHandle((DenseSegment(kf, vf),))
    else:
        handle = decode_handle(cache_kinds()[label], config, x["k"], x["v"], x["k1"], x["v1"])[0]

    def step():
        return decode_attention(x["query"], handle, None, scaling)

    step()  # compiled and warm
    _sync(dev)
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        step()
    issued = (time.perf_counter() - start) / HOST_CALLS
    _sync(dev)
    waited = (time.perf_counter() - start) / HOST_CALLS
    syncs = _count_syncs(step, dev)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(HOST_CALLS):
        step()
    profile.disable()
    _sync(dev)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:HOST_TOP]
    functions = [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": calls / HOST_CALLS,
                  "own_us_per_step": 1e6 * own / HOST_CALLS, "cumulative_us_per_step": 1e6 * cum / HOST_CALLS}
                 for (f, line, name), (calls, _, own, cum, _) in top]  # fmt: skip
    return {"measure": "host", "context": context, "batch": batch, "kind": label,
            "host_us_per_call": 1e6 * issued, "wall_us_per_call": 1e6 * waited, "syncs_per_call": syncs,
            "python_functions": functions}  # fmt: skip


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _count_syncs(step, dev) -> int | None:
    """Device-to-host syncs one call makes (CUDA's sync debug mode counts them as warnings), None off CUDA."""
    if dev.type != "cuda":
        return None
    import warnings

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(w.message) for w in caught)


def _cell(record: StageRecord, config, dev, dtype, context: int, batch: int, peak: float | None) -> None:
    """sdpa, our kernel over dense K/V, then every cache kind, at one (context, batch)."""
    scaling = config.head_dim**-0.5
    x = _inputs(config, dev, dtype, context, batch)
    k, v, k1, v1, query = x["k"], x["v"], x["k1"], x["v1"], x["query"]
    kf, vf = torch.cat([k, k1], 2), torch.cat([v, v1], 2)  # what DynamicCache holds after the step
    sdpa, backend = _sdpa(query, kf, vf, scaling)
    base = bench(sdpa, dev)
    base_graph = _device_only(sdpa, dev)
    query_bytes = query.numel() * query.element_size()
    base_bytes = 2 * kf.numel() * kf.element_size() + query_bytes
    cell = {"context": context, "batch": batch}
    record.add(cell | {"kind": "sdpa", "backend": backend, "bytes": base_bytes, **_rates(base, base_bytes, peak)}
               | _graph_fields(base_graph, base_graph, base_bytes, peak))  # fmt: skip
    kinds = {"dense": None, **cache_kinds()}
    for label, spec in kinds.items():
        if record.out_of_time(f"{label} {context} x {batch}", 2):
            continue
        try:
            if spec is None:  # our kernel over the bf16 K/V sdpa reads
                handle, nbytes = KVHandle((DenseSegment(kf, vf),)), base_bytes
            else:
                handle, _, nbytes = decode_handle(spec, config, k, v, k1, v1)
                nbytes += query_bytes

            def step(handle=handle):
                return decode_attention(query, handle, None, scaling)

            timing = bench(step, dev)
            graph = _device_only(step, dev)
        except Exception as err:
            record.error(f"{label} {context} x {batch}", err)
            continue
        item = cell | {"kind": label, "bytes": nbytes, "segments": [type(s).__name__ for s in handle.segments]}
        item |= _rates(timing, nbytes, peak) | {"speedup_vs_sdpa": base.median_s / timing.median_s}
        record.add(item | _graph_fields(graph, base_graph, nbytes, peak))


def _variants(config, dev, dtype, context: int, batch: int, label: str, variants) -> list[dict]:
    """One kind's step under its own plan, then under each variant (fields replaced in every partial launch)."""
    scaling = config.head_dim**-0.5
    x = _inputs(config, dev, dtype, context, batch)
    handle = decode_handle(cache_kinds()[label], config, x["k"], x["v"], x["k1"], x["v1"])[0]

    def step():
        return decode_attention(x["query"], handle, None, scaling)

    items, base = [], None
    for variant, under, diff in each_plan(step, ("", *variants)):
        timing, graph = bench(under, dev), _device_only(under, dev)
        item = {"measure": "variant", "context": context, "batch": batch, "kind": label, "plan": variant}
        item |= timing.as_dict() | _graph_fields(graph, None, 0, None)
        if base is None:
            base = item
        else:
            item["max_diff_vs_plan"] = diff
            item["speedup_vs_plan"] = base["median_us"] / item["median_us"]
            if "graph_us" in item and "graph_us" in base:
                item["graph_speedup_vs_plan"] = base["graph_us"] / item["graph_us"]
        items.append(item)
    return items


def _device_only(step, dev):
    """The step's time as one CUDA-graph replay (:func:`~.timing.graphed`): a Timing, or the reason it could not be
    captured; None off CUDA."""
    if dev.type != "cuda":
        return None
    try:
        return bench(graphed(step), dev, seconds=GRAPH_SECONDS)
    except Exception as err:  # noqa: BLE001 (reported beside the issued time, which stands on its own)
        return f"{type(err).__name__}: {str(err).strip()[:200]}"


def _graph_fields(graph, base_graph, nbytes: int, peak: float | None) -> dict:
    """A cell's device-only fields: ``graph_us``, ``graph_speedup_vs_sdpa`` (over sdpa's replay) and
    ``graph_of_peak``, or ``graph_error``."""
    if graph is None:
        return {}
    if isinstance(graph, str):
        return {"graph_error": graph}
    out = {"graph_us": 1e6 * graph.median_s}
    if isinstance(base_graph, Timing):
        out["graph_speedup_vs_sdpa"] = base_graph.median_s / graph.median_s
    if peak:
        out["graph_of_peak"] = nbytes / graph.median_s / peak
    return out


def _rates(timing, nbytes: int, peak: float | None) -> dict:
    out = timing.as_dict() | {"bytes_per_s": nbytes / timing.median_s}
    if peak:
        out |= {"of_peak": nbytes / timing.median_s / peak, "roofline_us": 1e6 * nbytes / peak}
    return out


def headline(record: dict) -> list[str]:
    info = record.get("info", {})
    lines = [f"triton kernels: {'yes' if info.get('triton') else 'NO: ' + str(info.get('triton_error'))}"]
    by_cell: dict = {}
    for item in record.get("items", []):
        if item.get("measure") == "host":
            top = item["python_functions"][0] if item["python_functions"] else {}
            lines.append(f"host {item['kind']} {item['context']} x {item['batch']}: issues a call in "
                         f"{item['host_us_per_call']:.0f}us (with the device {item['wall_us_per_call']:.0f}us), "
                         f"{item['syncs_per_call']} syncs; top {top.get('function')} "
                         f"{top.get('own_us_per_step', 0):.0f}us")  # fmt: skip
            continue
        if item.get("measure") == "variant":
            device = f", device {item['graph_us']:.0f}us" if "graph_us" in item else ""
            ratio = f" ({item['speedup_vs_plan']:.2f}x the plan)" if "speedup_vs_plan" in item else ""
            lines.append(f"variant {item['kind']} [{item['plan'] or 'plan'}] {item['context']} x {item['batch']}: "
                         f"{item['median_us']:.0f}us{ratio}{device}")  # fmt: skip
            continue
        by_cell.setdefault((item["context"], item["batch"]), []).append(item)
    for (context, batch), items in by_cell.items():
        parts = []
        for item in items:
            share = f" {item['of_peak']:.0%}bw" if "of_peak" in item else ""
            speed = f" {item['speedup_vs_sdpa']:.2f}x" if "speedup_vs_sdpa" in item else ""
            device = f" (device {item['graph_us']:.0f}us)" if "graph_us" in item else ""
            parts.append(f"{item['kind']} {item['median_us']:.0f}us{speed}{share}{device}")
        lines.append(f"{context} x {batch}: " + ", ".join(parts))
    return lines
