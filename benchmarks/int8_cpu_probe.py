"""Could an int8 history decode faster than float32 ``DynamicCache`` on CPU? One attention layer-step, timed.

At 4k tokens x batch 4 a float32 history is read every decode step and outweighs the weights, so attention over int8
codes could beat sdpa over float32 if the dot products run on int8. Timed here, side by side, for one layer and one
decode step at SmolLM2's attention shape (9 query / 3 KV heads, head_dim 64):

- ``sdpa fp32``: ``scaled_dot_product_attention`` over float32 K/V (what ``DynamicCache`` + sdpa does);
- ``dequantize + sdpa``: int8 codes x per-token scales back to float32, then sdpa (what a cache that materializes does);
- ``fold``: float32 matmuls on the int8 codes, the per-token key scales folded into the scores and the value scales
  into the probabilities (what the kernels' reference does);
- ``int_mm``: the query quantized per row to int8, ``torch._int_mm`` (int8 x int8 -> int32) against keys stored
  transposed, scales folded as above, float32 P.V on the value codes. One ``_int_mm`` per (row, KV head): the op is 2-D.

Every variant's output is compared with sdpa's (max abs difference). A probe, not a cache: no int8 layout in
hf_kvcache stores keys transposed today.

    python benchmarks/int8_cpu_probe.py                       # 4k x 4, 1 thread
    python benchmarks/int8_cpu_probe.py --tokens 1024 --batch 1
"""

from __future__ import annotations

import argparse
import time

import torch


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return (x / scale).round().to(torch.int8), scale.squeeze(-1)


def probe(batch: int, tokens: int, q_heads: int, kv_heads: int, head_dim: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    group = q_heads // kv_heads
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    kq, ks = _quantize(k)
    vq, vs = _quantize(v)
    kt = kq.transpose(-1, -2).contiguous()  # (B, H, D, T): _int_mm's right operand
    qg = q.view(batch, kv_heads, group, head_dim)
    qq, qs = _quantize(qg)
    scaling = head_dim**-0.5
    rows = max(17, group)  # _int_mm needs more than 16 rows: the query rows, zero-padded

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def dequantize():
        kk, vv = kq.float() * ks[..., None], vq.float() * vs[..., None]
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    def fold():
        s = torch.matmul(qg, kq.transpose(-1, -2).float()) * ks[:, :, None, :] * scaling
        return torch.matmul(s.softmax(-1) * vs[:, :, None, :], vq.float()).reshape(q.shape)

    def int_mm():
        out = torch.empty(batch, kv_heads, group, head_dim)
        padded = torch.zeros(rows, head_dim, dtype=torch.int8)
        for b in range(batch):
            for h in range(kv_heads):
                padded[:group] = qq[b, h]
                s = torch._int_mm(padded, kt[b, h])[:group].float() * (qs[b, h, :, None] * ks[b, h] * scaling)
                out[b, h] = (s.softmax(-1) * vs[b, h]) @ vq[b, h].float()
        return out.reshape(q.shape)

    ref = sdpa()
    results = []
    for name, fn in (("sdpa fp32", sdpa), ("dequantize + sdpa", dequantize), ("fold", fold), ("int_mm", int_mm)):
        ms = _time(fn, repeats)
        results.append({"variant": name, "ms": ms, "max abs diff": float((fn() - ref).abs().max())})
    base = results[0]["ms"]
    for r in results:
        r["x sdpa"] = base / r["ms"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.q_heads % args.kv_heads:
        raise SystemExit(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    torch.set_num_threads(args.threads)
    rows = probe(args.batch, args.tokens, args.q_heads, args.kv_heads, args.head_dim, args.repeats)
    print(f"one layer-step, {args.tokens} tokens x batch {args.batch}, {args.q_heads}/{args.kv_heads} heads x "
          f"{args.head_dim}, {args.threads} thread(s), float32")  # fmt: skip
    print(f"{'variant':20s} {'ms':>8s} {'x sdpa':>7s} {'max abs diff':>13s}")
    for r in rows:
        print(f"{r['variant']:20s} {r['ms']:8.3f} {r['x sdpa']:7.2f} {r['max abs diff']:13.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
