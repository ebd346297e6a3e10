"""Where a decode step's host time goes on a GPU machine: one layer's step at 4k x 1 (host-bound: its kernels take
13-50 us of device time, the step 240-1500 us as issued) for a few kinds, issued through the public path and through
each layer below it, so the difference between rows is what a layer costs.

Run on a GPU machine from the project's root: ``python benchmarks/gpu_host_probe.py``.
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_kvcache.formats import DenseSegment, KVHandle, decode_attention  # noqa: E402
from hf_kvcache.formats._base import launch  # noqa: E402
from hf_kvcache.formats.handle import segment_inputs  # noqa: E402
from hf_kvcache.kernels.ops import combine_partials  # noqa: E402
from hf_kvcache.kernels.triton_decode import triton_combine, triton_partial  # noqa: E402
from hf_kvcache.tools.gpu_run.kernels import _inputs, decode_handle  # noqa: E402
from hf_kvcache.tools.gpu_run.shapes import cache_kinds, model_config  # noqa: E402

CALLS = 300


def issued_us(fn) -> float:
    """Host time to issue one call, the device never waited on (the step is host-bound at this shape)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    issued = (time.perf_counter() - start) / CALLS
    torch.cuda.synchronize()
    return 1e6 * issued


@torch.library.custom_op("probe::noop", mutates_args=())
def _noop(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@_noop.register_fake
def _(x):
    return x.new_empty(0)


def main() -> None:
    try:
        import torch._library.custom_ops as co

        src = inspect.getsource(co)
        i = src.index("def backend_impl")
        print(src[i : i + 2400])
    except Exception as err:  # noqa: BLE001
        print("no source:", err)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    config = model_config(False, layers=1)
    scaling = config.head_dim**-0.5
    x = _inputs(config, dev, dtype, 4096, 1)
    query = x["query"]
    print(f"noop custom op: {issued_us(lambda: _noop(query)):.1f} us")
    print(f"torch.empty x3: {issued_us(lambda: [torch.empty((1, 8, 4, 8), device=dev) for _ in range(3)]):.1f} us")
    kf, vf = torch.cat([x["k"], x["k1"]], 2), torch.cat([x["v"], x["v1"]], 2)
    kinds = {"dense": None} | {k: v for k, v in cache_kinds().items() if k in ("int8", "int2 KIVI layout", "int3")}
    for label, spec in kinds.items():
        if spec is None:
            handle = KVHandle((DenseSegment(kf, vf),))
        else:
            handle = decode_handle(spec, config, x["k"], x["v"], x["k1"], x["v1"])[0]
        inputs = [(s, *s.in_launch(), pm, n) for s, pm, n in segment_inputs(query, handle, None)]
        rows = {"decode_attention": lambda: decode_attention(query, handle, None, scaling)}
        if all(not extras for _, _, extras, _, _ in inputs):

            def bypass():
                parts = [launch(query, st, pm, scaling, 0.0, n) for _, st, _, pm, n in inputs]
                return triton_combine(parts, None, dtype)

            ready = [(st.kernel_storage(), st.launch_plan(query, pm), pm, n) for _, st, _, pm, n in inputs]

            def kernels_only():
                parts = [triton_partial(query, s, p, pm, scaling, 0.0, n) for s, p, pm, n in ready]
                return triton_combine(parts, None, dtype)

            parts = [triton_partial(query, s, p, pm, scaling, 0.0, n) for s, p, pm, n in ready]
            m, l_, acc = (list(t) for t in zip(*parts))
            rows |= {
                "formats' launch + triton_combine (no custom ops)": bypass,
                "triton_partial + triton_combine (storage, plan ready)": kernels_only,
                "one triton_partial": lambda: triton_partial(
                    query, *ready[0][:2], ready[0][2], scaling, 0.0, ready[0][3]
                ),  # fmt: skip
                "kernel_storage + launch_plan, every segment": lambda: [
                    (st.kernel_storage(), st.launch_plan(query, pm)) for _, st, _, pm, _ in inputs
                ],
                "combine custom op": lambda: combine_partials(m, l_, acc, None, dtype),
                "triton_combine": lambda: triton_combine(parts, None, dtype),
            }
        print(f"{label} ({len(inputs)} segments):")
        for name, fn in rows.items():
            print(f"  {name}: {issued_us(fn):.1f} us", flush=True)


if __name__ == "__main__":
    main()
