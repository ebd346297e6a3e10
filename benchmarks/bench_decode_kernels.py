"""The fused decode attention alone, against sdpa over full-precision K/V of the same shape.

Decode attention is memory-bound: one query token per row reads the whole history. This times one decode step of one
layer (Llama-3-8B's attention shape by default: 32 query / 8 KV heads, head_dim 128) for each storage kind (dense,
KIVI 4/2-bit, int8, and paged pools of 16-token pages in shuffled order, full precision or int8), with
the kernels of :mod:`hf_kvcache.kernels` reading the storage in place, next to ``torch.nn.functional.
scaled_dot_product_attention`` over bf16 K/V (what ``DynamicCache`` + sdpa reads). It reports the median time, the
speed-up over sdpa, the bytes each step must read and the achieved bandwidth as a fraction of the device's peak
(from its memory clock and bus width, or ``--peak-gbs``).

End-to-end ``generate()`` speed is diluted by transformers' per-step Python overhead; this is the kernel level::

    python benchmarks/bench_decode_kernels.py --device cuda --dtype bfloat16
    python benchmarks/bench_decode_kernels.py --device cpu --contexts 1024 --batch 1 --repeats 3   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

from hf_kvcache._validate import dtype_from_name
from hf_kvcache.kernels import DenseSegment, KVHandle, PagedSegment, decode_attention
from hf_kvcache.kernels.formats import Int8Codec, KiviCodec
from hf_kvcache.layers.paged import page_codec


def _paged(k: torch.Tensor, v: torch.Tensor, bits: int | None, block_size: int = 16) -> PagedSegment:
    """K/V written into a pool of ``block_size``-token pages in shuffled order, read back through the block table."""
    batch, heads, length, _ = k.shape
    per_row = -(-length // block_size)
    table = torch.randperm(batch * per_row, device=k.device).view(batch, per_row).int()
    slots = table.long().repeat_interleave(block_size, 1) * block_size + torch.arange(
        block_size, device=k.device
    ).repeat(per_row)
    slots = slots[:, :length].flatten()

    codec = page_codec(bits)  # the paged cache's own page encoding

    def pool(x: torch.Tensor):
        flat = x.transpose(1, 2).reshape(batch * length, heads, -1)  # (B * T, H, D)
        out = torch.zeros(batch * per_row * block_size, heads, x.shape[-1], dtype=x.dtype, device=x.device)
        if codec is None:
            out[slots] = flat
            return out, None
        codes, scale = codec._encode_one(flat)
        out, scales = out.to(torch.int8), torch.zeros(out.shape[:2], device=x.device)
        out[slots], scales[slots] = codes, scale.squeeze(-1)
        return out, scales

    (keys, key_scales), (values, value_scales) = pool(k), pool(v)
    return PagedSegment(keys, values, table, block_size, length, key_scales, value_scales)


def _segment(kind: str, k: torch.Tensor, v: torch.Tensor):
    if kind == "dense":
        return DenseSegment(k, v)
    if kind in ("paged", "paged8"):
        return _paged(k, v, 8 if kind == "paged8" else None)
    codec = Int8Codec(None, torch.float32) if kind == "int8" else KiviCodec(int(kind[-1]), 64, None)
    return codec.segment(codec.encode(k, v))


def _nbytes(segment) -> int:
    """Bytes a decode step reads (a paged pool is read through its table: only the slots the rows use, here all)."""
    return sum(t.numel() * t.element_size() for t in vars(segment).values() if isinstance(t, torch.Tensor))


def _time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (and Triton compilation)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bandwidth(device: torch.device, override: float | None) -> float | None:
    """Bytes/s the device's memory can deliver: ``--peak-gbs``, or clock x bus width x 2 (DDR) when torch says."""
    if override:
        return override * 1e9
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock, bus = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    return 2 * clock * 1e3 * bus / 8 if clock and bus else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="query and full-precision K/V dtype")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="4096,16384,32768", help="comma-separated history lengths")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--kinds",
        default="dense,int8,int4,int2,paged,paged8",
        help="storage kinds to time (paged / paged8: 16-token pages in shuffled order, full precision / int8)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's peak memory bandwidth, GB/s")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = dtype_from_name("--dtype", args.dtype)
    peak = peak_bandwidth(device, args.peak_gbs)
    rows = []
    for batch in (int(x) for x in args.batch.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            g = torch.Generator(device=device).manual_seed(0)
            shape = (batch, args.kv_heads, context, args.head_dim)
            k = torch.randn(shape, generator=g, device=device, dtype=dtype)
            v = torch.randn(shape, generator=g, device=device, dtype=dtype)
            query = torch.randn((batch, args.heads, 1, args.head_dim), generator=g, device=device, dtype=dtype)
            scaling = args.head_dim**-0.5

            def sdpa():
                return torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scaling, enable_gqa=True)

            base = _time(sdpa, args.repeats, device)
            base_bytes = 2 * k.numel() * k.element_size()
            rows.append(
                [batch, context, f"sdpa ({args.dtype} K/V)", f"{1e6 * base:.0f}", "1.00", f"{base_bytes / 2**20:.0f}"]
            )
            rows[-1].append(f"{base_bytes / base / peak:.0%}" if peak else "n/a")
            for kind in args.kinds.split(","):
                segment = _segment(kind, k, v)
                handle = KVHandle((segment,))
                seconds = _time(lambda: decode_attention(query, handle, None, scaling), args.repeats, device)
                nbytes = _nbytes(segment)
                rows.append(
                    [
                        batch,
                        context,
                        f"hf_kvcache {kind}",
                        f"{1e6 * seconds:.0f}",
                        f"{base / seconds:.2f}",
                        f"{nbytes / 2**20:.0f}",
                        f"{nbytes / seconds / peak:.0%}" if peak else "n/a",
                    ]
                )

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (the pure-torch reference)"
    print(f"{name}, {args.dtype}, {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, one decode step\n")
    headers = ["batch", "context", "kernel", "µs", "x sdpa", "MiB read", "of peak bandwidth"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
