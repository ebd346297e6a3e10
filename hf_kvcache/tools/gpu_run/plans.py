"""Launch-plan variants: a format's plan (:class:`~hf_kvcache.kernels.storage.LaunchPlan`) with some fields replaced
in every partial launch, so a tuning choice is timed beside the plan the formats choose, in the same run, on the
same inputs. The GPU run's ``kernels`` stage times :data:`VARIANTS`; ``benchmarks/gpu_graph_probe.py --plans`` and
``benchmarks/aot_plans.py`` take any."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator

from ...kernels.storage import LaunchPlan

__all__ = ["VARIANTS", "each_plan", "plan_fields", "planned"]

# Kind (a label of shapes.CACHE_KINDS) -> variants the kernels stage times beside its plan: candidates waiting for
# a GPU to decide them. angle_table: pre-RoPE keys turned from the cos / sin table, not per-element polynomials.
# int8's plan (one stage: resident warps instead of cp.async stages) came from compile figures alone; pipelined
# tiles compile to 12 warps per SM (64 tokens) or 16 (32 tokens). int4 (0.56x sdpa on the device, 6% of its bandwidth:
# latency-bound): compiled for sm_90, 2 stages keep its 12 warps per SM (152 registers against 154) and prefetch the
# next key group; 8 warps hold 16 per SM (116 registers) for 48% more instructions per token.
# half_codes: int8 keys enter the scores' product as float16 1152 + code (a byte permute per two codes) instead of
# being converted to bfloat16 (two instructions a code): compiled for sm_90 at 16k x 8, 36.2 main-loop instructions
# per token against 40.9 for int8 (paged int8 47.1 against 51.2), the same 16 warps per SM.
# fill_waves=false: the split count of the fixed program target (576 programs at 16k x 8), against the plans' default
# count that fills whole waves of the SMs (hf_kvcache.kernels.waves): the side-by-side test of why int8 ran at 0.79x
# sdpa at 16k x 8 (576 programs, 528 resident: two waves) and 1.19x at 16k x 1 (512 programs, one wave).
VARIANTS = {
    "int8": ("fill_waves=false", "half_codes=true", "stages=2", "block_n=32:stages=2"),
    "int2": ("fill_waves=false", "angle_table=true"),
    "int3": ("angle_table=true",),
    "paged int8": ("fill_waves=false", "half_codes=true"),
    "int4": ("fill_waves=false", "stages=2", "warps=8"),  # last: the box reaches the candidates waiting longer first
}


def plan_fields(text: str) -> dict:
    """``"warps=4:stages=1"`` -> ``{"warps": 4, "stages": 1}``, the LaunchPlan fields it sets (``true`` / ``false``
    for flags); a ValueError naming the fields there are for anything else."""
    names = {f.name: f.type for f in dataclasses.fields(LaunchPlan)}
    fields: dict = {}
    for item in filter(None, text.split(":")):
        name, _, value = item.partition("=")
        flag = names.get(name) in (bool, "bool")
        ok = name in names and (value.lower() in ("true", "false") if flag else value.isdigit())
        if not ok:
            raise ValueError(f"--plans: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(names)}")
        fields[name] = value.lower() == "true" if flag else int(value)
    return fields


@contextlib.contextmanager
def planned(fields: dict):
    """Within the block, every Triton partial launch runs with its plan's ``fields`` replaced."""
    if not fields:
        yield
        return
    from ...kernels import triton_decode  # Triton only where a variant runs

    original = triton_decode.triton_partial

    def replaced(query, storage, plan, *args):
        return original(query, storage, plan.replace(**fields), *args)

    triton_decode.triton_partial = replaced
    try:
        yield
    finally:
        triton_decode.triton_partial = original


def each_plan(step: Callable, variants: Iterable[str]) -> Iterator[tuple[str, Callable, float | None]]:
    """For each variant text (``""``: the formats' own plan): ``(variant, step under it, the largest difference of its
    output from the first variant's)``, None for the first. Each step is run once here, so a variant that fails to
    compile raises before it is timed."""
    first = None
    for variant in variants:
        fields = plan_fields(variant)

        def under(fields=fields):
            with planned(fields):
                return step()

        out = under().float()
        yield variant, under, None if first is None else (out - first).abs().max().item()
        if first is None:
            first = out
