"""How many programs of a compiled kernel an SM holds at once, and a split count that fills whole waves of them.

A decode launch is a grid of (batch x KV heads, splits) programs, each walking its split of the tokens. The GPU runs
them in waves: every SM holds as many programs as its registers, shared memory and warp slots allow (the CUDA
occupancy calculator's rules, :func:`occupancy`), and a program that does not fit waits for one to finish. Programs of
equal work finish together, so a grid of 576 programs on an H200 whose SMs hold 4 each (528 at a time) takes two
program times, the second wave holding 48: the first GPU runs measured int8's step at 16k tokens x 8 rows (576
programs) at 0.79x sdpa's device time and at 16k x 1 (512 programs, one wave) at 1.19x. :func:`wave_splits` picks the
split count that finishes soonest when programs are latency-bound (each tile of tokens costs the same time whatever
runs beside it), from the kernel's measured residency (:func:`resident_programs`, read from the compiled kernel on
its first launch).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["SMLimits", "SM_LIMITS", "occupancy", "resident_programs", "sm_count", "wave_splits"]


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of a compute capability (CUDA C Programming Guide, "Compute capabilities" table)."""

    regs: int = 65536  # 32-bit registers per SM
    reg_unit: int = 256  # registers are allocated per warp in units of 256
    sub_partitions: int = 4  # an SM's register file is split between 4 schedulers
    max_warps: int = 64
    max_blocks: int = 32
    smem: int = 0  # shared memory per SM usable by blocks, bytes
    smem_per_block: int = 0  # the most one block may request
    smem_reserved: int = 1024  # the driver reserves 1 KB per resident block (sm_80 and later)


SM_LIMITS = {
    80: SMLimits(smem=164 * 1024, smem_per_block=163 * 1024),  # A100
    86: SMLimits(max_warps=48, max_blocks=16, smem=100 * 1024, smem_per_block=99 * 1024),  # RTX 30, A10, A40
    89: SMLimits(max_warps=48, max_blocks=24, smem=100 * 1024, smem_per_block=99 * 1024),  # RTX 40, L4, L40
    90: SMLimits(smem=228 * 1024, smem_per_block=227 * 1024),  # H100, H200
}


def occupancy(arch: int, regs: int, shared: int, warps: int) -> dict:
    """Resident blocks per SM and what limits them (the CUDA occupancy calculator's rules: registers rounded up to
    256 per warp and split across 4 sub-partitions; shared memory plus 1 KB reserved per block)."""
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-max(regs, 1) * 32 // lim.reg_unit) * lim.reg_unit
    warps_by_regs = (lim.regs // lim.sub_partitions // regs_per_warp) * lim.sub_partitions
    limits = {
        "registers": warps_by_regs // warps,
        "shared memory": lim.smem // (shared + lim.smem_reserved) if shared <= lim.smem_per_block else 0,
        "warps": lim.max_warps // warps,
        "blocks": lim.max_blocks,
    }
    blocks = min(limits.values())
    limiter = " + ".join(k for k, v in limits.items() if v == blocks)  # every limit that binds
    return {"blocks_per_sm": blocks, "limited_by": limiter, "fits": shared <= lim.smem_per_block}


@functools.cache
def _device(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major * 10 + props.minor


def _of(device: torch.device) -> tuple[int, int]:
    """``(SMs, compute capability as 90)`` of a CUDA device, read once per device."""
    return _device(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device)."""
    return _of(device)[0]


def resident_programs(kernel, device: torch.device) -> int | None:
    """Programs of a compiled Triton kernel (what a launch returns) one SM of ``device`` holds at once; None where
    the kernel's figures or the device's limits are unknown (the interpreter returns no kernel; architectures not in
    :data:`SM_LIMITS`)."""
    arch = _of(device)[1]
    regs = getattr(kernel, "n_regs", None)
    metadata = getattr(kernel, "metadata", None)
    if arch not in SM_LIMITS or not regs or metadata is None:
        return None
    blocks = occupancy(arch, regs, metadata.shared, metadata.num_warps)["blocks_per_sm"]
    return blocks or None


def wave_splits(length: int, programs: int, slots: int, block_n: int, most: int) -> int:
    """The split count in ``1 .. most`` whose grid finishes soonest: ``programs`` programs per split run in waves of
    ``slots`` (SMs x resident programs), each program taking a time proportional to its tiles of ``block_n`` tokens
    plus one tile's worth for what every program does once (the query's load, the partials' store); the fewer splits
    where two finish together (fewer partials to combine)."""
    best, best_cost = 1, None
    for s in range(1, max(1, most) + 1):
        per_split = -(-length // s)
        tiles = -(-per_split // block_n)
        cost = -(-programs * s // slots) * (tiles + 1)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best
