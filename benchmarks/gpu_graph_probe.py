"""Is a decode step host-bound or kernel-bound on the GPU? One layer's step (the GPU run's ``kernels`` cells) timed
three ways side by side: as issued from Python (``decode_attention`` over the layer's handle, what ``generate()``
pays), as one CUDA-graph replay of the same step (the device's time alone: no Python, no dispatcher, no Triton
launcher), and, from the profiler, the launches per step and their summed kernel time.

Run on a GPU machine from the project's root: ``python benchmarks/gpu_graph_probe.py --output DIR``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_kvcache.formats import DenseSegment, KVHandle, decode_attention  # noqa: E402
from hf_kvcache.tools.gpu_run.kernels import _inputs, _sdpa, decode_handle  # noqa: E402
from hf_kvcache.tools.gpu_run.plans import plan_fields, planned  # noqa: E402
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
        plans = [plan_fields(text) for text in args.plans]
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
        kf, vf = torch.cat([x["k"], x["k1"]], 2), torch.cat([x["v"], x["v1"]], 2)
        sdpa, _ = _sdpa(x["query"], kf, vf, scaling)
        base = bench(sdpa, dev).median_s
        print(f"{context} x {batch}: sdpa {1e6 * base:.0f}us", flush=True)
        for (label, spec), (variant, fields) in itertools.product(kinds.items(), zip(args.plans, plans)):
            if time.perf_counter() > deadline:
                print("budget spent", flush=True)
                break
            row = {"context": context, "batch": batch, "kind": label, "sdpa_us": 1e6 * base}
            if variant:
                row["plan"] = variant
            try:
                if spec is None:
                    handle = KVHandle((DenseSegment(kf, vf),))
                else:
                    handle = decode_handle(spec, config, x["k"], x["v"], x["k1"], x["v1"])[0]

                def step(handle=handle, query=x["query"], fields=fields):
                    with planned(fields):
                        return decode_attention(query, handle, None, scaling)

                out = step().float()
                if variant == args.plans[0]:
                    first = out
                else:
                    row["max_diff_vs_first_plan"] = (out - first).abs().max().item()
                row["eager_us"] = 1e6 * bench(step, dev).median_s
                row |= kernel_profile(step)
                try:
                    row["graph_us"] = 1e6 * bench(graphed(step), dev).median_s
                except Exception as err:  # noqa: BLE001 (a step that syncs cannot be captured: say so)
                    row["graph_error"] = f"{type(err).__name__}: {str(err)[:160]}"
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:160]}"
            rows.append(row)
            nan = float("nan")
            eager, graph, kern = (row.get(key, nan) for key in ("eager_us", "graph_us", "kernel_us"))
            note = row.get("error", row.get("graph_error", ""))
            label = f"{label} [{variant}]" if variant else label
            print(f"  {label}: eager {eager:.0f}us, graph {graph:.0f}us ({1e6 * base / graph:.2f}x sdpa), "
                  f"{row.get('launches', 0):.0f} launches, kernels {kern:.0f}us {note}", flush=True)  # fmt: skip
        del x, kf, vf
        torch.cuda.empty_cache()
        (args.output / "graph_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
