"""Is a decode step host-bound or kernel-bound on the GPU? One layer's step (the GPU run's ``kernels`` cells) timed
three ways side by side: as issued from Python (``decode_attention`` over the layer's handle, what ``generate()``
pays), as one CUDA-graph replay of the same step (the device's time alone: no Python, no dispatcher, no Triton
launcher), and, from the profiler, the launches per step and their summed kernel time.

Run on a GPU machine from the project's root: ``python benchmarks/gpu_graph_probe.py --output DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_kvcache.formats import DenseSegment, KVHandle, decode_attention  # noqa: E402
from hf_kvcache.tools.gpu_run.kernels import _inputs, _sdpa, decode_handle  # noqa: E402
from hf_kvcache.tools.gpu_run.plans import each_plan, plan_fields  # noqa: E402
from hf_kvcache.tools.gpu_run.shapes import cache_kinds, model_config  # noqa: E402
from hf_kvcache.tools.gpu_run.timing import bench, graphed  # noqa: E402

SHAPES = ((16384, 8), (4096, 1), (65536, 8))
KINDS = ("dense", "int8", "int4", "int3", "int2", "int2 KIVI layout", "paged", "fp8")


def kernel_profile(fn) -> dict:
    """Launches per call and their summed device time (CUPTI), over 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names: dict[str, float] = {}
    for e in events:
        names[e.name[:60]] = names.get(e.name[:60], 0.0) + e.device_time / 5
    return {"launches": len(events) / 5, "kernel_us": sum(e.device_time for e in events) / 5, "by_kernel_us": names}


def probe_kind(cell: dict, spec, x: dict, plans: list[str], config, base_s: float, deadline: float) -> list[dict]:
    """One kind's step (``cell``: context, batch, kind; ``x``: the cell's inputs, ``kf`` / ``vf`` the dense K/V) under
    each plan variant: issued, as a graph replay, and its launches; rows printed as they are made."""
    scaling = config.head_dim**-0.5
    kf, vf = x["kf"], x["vf"]
    cell = cell | {"sdpa_us": 1e6 * base_s}
    rows = []
    try:
        if spec is None:
            handle = KVHandle((DenseSegment(kf, vf),))
        else:
            handle = decode_handle(spec, config, x["k"], x["v"], x["k1"], x["v1"])[0]

        def step():
            return decode_attention(x["query"], handle, None, scaling)

        for variant, under, diff in each_plan(step, plans):
            row = cell | ({"plan": variant} if variant else {})
            if diff is not None:
                row["max_diff_vs_first_plan"] = diff
            row["eager_us"] = 1e6 * bench(under, kf.device).median_s
            row |= kernel_profile(under)
            try:
                row["graph_us"] = 1e6 * bench(graphed(under), kf.device).median_s
            except Exception as err:  # noqa: BLE001 (a step that syncs cannot be captured: say so)
                row["graph_error"] = f"{type(err).__name__}: {str(err)[:160]}"
            rows.append(_printed(row, base_s))
            if time.perf_counter() > deadline:
                break
    except Exception as err:  # noqa: BLE001 (recorded; the next kind runs)
        rows.append(_printed(cell | {"error": f"{type(err).__name__}: {str(err)[:160]}"}, base_s))
    return rows


def _printed(row: dict, base_s: float) -> dict:
    nan = float("nan")
    eager, graph, kern = (row.get(key, nan) for key in ("eager_us", "graph_us", "kernel_us"))
    note = row.get("error", row.get("graph_error", ""))
    label = f"{row['kind']} [{row['plan']}]" if row.get("plan") else row["kind"]
    print(f"  {label}: eager {eager:.0f}us, graph {graph:.0f}us ({1e6 * base_s / graph:.2f}x sdpa), "
          f"{row.get('launches', 0):.0f} launches, kernels {kern:.0f}us {note}", flush=True)  # fmt: skip
    return row


def _shape(cell: str) -> tuple[int, int]:
    try:
        context, batch = (int(n) for n in cell.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shapes: {cell!r} is not CONTEXTxBATCH, e.g. 65536x8") from None
    return context, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--specs", nargs="*", help="cache specs to time instead of the GPU run's kinds")
    parser.add_argument(
        "--shapes", nargs="*", help="context x batch cells, e.g. 65536x8 (default: 16k x 8, 4k x 1, 64k x 8)"
    )
    parser.add_argument(
        "--plans",
        nargs="*",
        default=[""],
        help="launch-plan variants timed side by side for each spec, as LaunchPlan fields, e.g. '' "
        "'warps=4:stages=1' (each output compared with the first variant's)",
    )
    args = parser.parse_args()
    try:
        for text in args.plans:  # a typo is an error before the GPU's minutes are spent
            plan_fields(text)
        shapes = [_shape(cell) for cell in args.shapes] if args.shapes else SHAPES
    except ValueError as err:
        parser.error(str(err))
    args.output.mkdir(parents=True, exist_ok=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    config = model_config(False, layers=1)
    scaling = config.head_dim**-0.5
    if args.specs:
        kinds = {spec: spec for spec in args.specs}
    else:
        kinds = {k: v for k, v in cache_kinds().items() if k in KINDS} | {"dense": None}  # dense syncs: captured last
    deadline = time.perf_counter() + args.budget_s
    rows = []
    for context, batch in shapes:
        x = _inputs(config, dev, dtype, context, batch)
        kf, vf = torch.cat([x["k"], x["k1"]], 2), torch.cat([x["v"], x["v1"]], 2)  # what DynamicCache holds
        x |= {"kf": kf, "vf": vf}
        sdpa, _ = _sdpa(x["query"], kf, vf, scaling)
        base = bench(sdpa, dev).median_s
        print(f"{context} x {batch}: sdpa {1e6 * base:.0f}us", flush=True)
        for label, spec in kinds.items():
            if time.perf_counter() > deadline:
                print("budget spent", flush=True)
                break
            cell = {"context": context, "batch": batch, "kind": label}
            rows += probe_kind(cell, spec, x, args.plans, config, base, deadline)
        del x, kf, vf
        torch.cuda.empty_cache()
        (args.output / "graph_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
