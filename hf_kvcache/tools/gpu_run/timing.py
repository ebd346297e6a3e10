"""Timing a GPU operation honestly: warm-up, the L2 cache flushed before every repeat (a decode step reads its cache
from HBM, not from L2, which holds 50 MB on an H100: a 4k-token layer would otherwise be read from L2), CUDA events
around each call, median and spread. On CPU: wall time of each call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Timing", "bench", "graphed"]

L2_FLUSH_BYTES = 256 * 2**20  # written before every repeat: larger than any GPU's L2


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    def as_dict(self) -> dict:
        return {"median_us": 1e6 * self.median_s, "p10_us": 1e6 * self.p10_s, "p90_us": 1e6 * self.p90_s,
                "repeats": self.repeats}  # fmt: skip


def _quantiles(times: list[float]) -> Timing:
    times = sorted(times)
    n = len(times)
    return Timing(statistics.median(times), times[int(0.1 * (n - 1))], times[int(0.9 * (n - 1) + 0.5)], n)


def bench(fn: Callable[[], object], device: torch.device, seconds: float = 0.25, min_reps: int = 5,
          max_reps: int = 200) -> Timing:  # fmt: skip
    """Time ``fn`` for about ``seconds`` after warm-up (the first call also compiles Triton kernels)."""
    fn()
    if device.type != "cuda":
        times = []
        deadline = time.perf_counter() + seconds
        while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return _quantiles(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    each = max((time.perf_counter() - start) / 3, 1e-6)
    reps = int(min(max(seconds / each, min_reps), max_reps))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for begin, end in events:
        flush.zero_()
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return _quantiles([begin.elapsed_time(end) / 1e3 for begin, end in events])


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once into a CUDA graph, returned as its replay: what the device takes for ``fn`` without the
    host's part (Python, the dispatcher, Triton's launcher), which a short step's issue time can exceed many times
    over. Warmed on a side stream first, as capture requires; raises where ``fn`` cannot be captured (a step that
    synchronizes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
