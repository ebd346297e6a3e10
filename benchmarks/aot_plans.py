"""Launch-plan variants compared without a GPU: each cache spec's decode launches at Llama-3-8B's attention shape,
compiled ahead of time for sm_80 / sm_90 under each variant (``LaunchPlan`` fields replaced, as
``gpu_graph_probe.py --plans`` replaces them on a GPU), with the figures that decide a latency-bound decode kernel:
registers, spills, resident warps per SM and main-loop SASS instructions per cached token.

    python benchmarks/aot_plans.py --specs int2 int3 --plans '' 'warps=4:stages=1'

Runs in a process without ``TRITON_INTERPRET`` (:mod:`hf_kvcache.tools.gpu_report.aot`); a variant that fails to
compile is printed as such.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_kvcache.layers import _common  # noqa: E402
from hf_kvcache.tools.gpu_report import aot  # noqa: E402
from hf_kvcache.tools.gpu_run.kernels import decode_handle  # noqa: E402
from hf_kvcache.tools.gpu_run.plans import plan_fields, planned  # noqa: E402
from hf_kvcache.tools.gpu_run.shapes import model_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", default=["int2", "int3"], help="cache specs (their quantized launches)")
    parser.add_argument("--plans", nargs="*", default=[""], help="LaunchPlan variants, e.g. '' 'warps=4:stages=1'")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(aot.TARGETS))
    parser.add_argument("--q-len", type=int, default=1, help="query tokens per step")
    args = parser.parse_args()
    try:
        plans = [plan_fields(text) for text in args.plans]
    except ValueError as err:
        parser.error(str(err))
    aot.check_compiled_mode()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    torch.set_num_threads(1)
    _common.CPU_HANDLES = "always"  # the layers' kernel-ready handles, built here on CPU tensors
    config = model_config(False, layers=1)
    kv, dim = config.num_key_value_heads, config.head_dim
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, kv, 1024, dim, generator=g).bfloat16() for _ in range(2))
    k1, v1 = (torch.randn(1, kv, 1, dim, generator=g).bfloat16() for _ in range(2))
    query = torch.randn(1, config.num_attention_heads, args.q_len, dim, generator=g).bfloat16()
    for spec in args.specs:
        handle = decode_handle(spec, config, k, v, k1, v1)[0]
        for text, fields in zip(args.plans, plans):
            with planned(fields), aot.capturing():
                launches = [aot.launch_partial(query, s, None, dim**-0.5, 0.0, 4) for s in handle.segments]
            for launch in filter(None, launches):
                if launch.segment == "DenseSegment":
                    continue
                for arch in args.arch:
                    label = f"{spec} {launch.segment} [{text}] sm_{arch}"
                    try:
                        c = aot.compile_launch(launch, arch)
                    except Exception as err:  # noqa: BLE001 (a variant that does not build is a result)
                        print(f"{label}: does not compile: {type(err).__name__}: {str(err)[:160]}", flush=True)
                        continue
                    per_token = c.loop_instructions * c.warps / launch.kwargs["BLOCK_N"]
                    print(
                        f"{label}: {c.warps} warps, {c.stages} stages, {c.registers} registers, spills "
                        f"{c.spill_stores}/{c.spill_loads} B, {c.blocks_per_sm * c.warps} warps/SM, "
                        f"{per_token:.1f} {c.loop_unit} instructions per token",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
