"""How each KIVI codebook reconstructs a model's keys and values, as a 4/3/2-bit cache stores them.

One prefill runs through a cache of ``--spec`` (default ``int2``: Hadamard-rotated codes, keys quantized before RoPE)
with no residual, and the keys and values its codec is handed are recorded. Each codebook
(:data:`hf_kvcache.quant.CODEBOOKS`) then quantizes them in the cache's groups (keys per channel over ``G`` tokens,
values per token over ``G`` channels) and the squared error is reported over every element and over the 1% that lie
furthest from their group's mean: the extremes, where a query's largest scores come from. Lloyd-Max levels minimize
the first by rounding the second inward, which is why they lose to the uniform grid through attention
(docs/caches/quantized.md, "A non-uniform codebook").

    python benchmarks/codebook_errors.py --model smollm2 --tokens 1024
"""

from __future__ import annotations

import argparse

import torch

from hf_kvcache import make_cache, quant
from hf_kvcache._compat import with_cache
from hf_kvcache.formats import kivi
from hf_kvcache.registry import parse_spec

from ._probe import add_common_flags, ratio_table, run_probe

__all__ = ["check_kivi_spec", "group_errors", "main", "measure", "stored_kv"]

KIVI_KINDS = ("int4", "int3", "int2")
TAIL = 0.01  # the share of elements, furthest from their group's mean, whose error is reported apart


def stored_kv(model, ids: torch.Tensor, spec: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """The keys and values a ``spec`` cache (no residual) encodes during one prefill of ``ids``, as its KIVI codec
    receives them (rotated, before RoPE, as the spec says), one ``(k, v)`` per call; and the codec's bits and group
    size."""
    check_kivi_spec(spec)
    cache = make_cache(spec, model, residual_length=0)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    # encode_into is what a layer calls (the CPU kernel or the torch encode then run inside it)
    encode_into = kivi.KiviCodec.encode_into

    def recording(codec, k, v, out):
        seen.append((k.detach().float().clone(), v.detach().float().clone()))
        return encode_into(codec, k, v, out)

    kivi.KiviCodec.encode_into = recording
    try:
        with torch.no_grad():
            model(ids, **with_cache(model, cache))
    finally:
        kivi.KiviCodec.encode_into = encode_into
    return seen, cache.bits, cache.group_size


def check_kivi_spec(spec: str) -> None:
    """A ``ValueError`` unless ``spec`` names a 4/3/2-bit kind (whose KIVI codes the codebooks place)."""
    if parse_spec(spec)[0] not in KIVI_KINDS:
        raise ValueError(f"spec: one of the {'/'.join(KIVI_KINDS)} kinds (KIVI codes), got {spec!r}")


def group_errors(x: torch.Tensor, bits: int, dim: int, codebook: torch.Tensor | None) -> tuple[float, float]:
    """Mean squared error of ``x`` quantized over ``dim`` (its groups), over all elements and over the
    :data:`TAIL` furthest from their group's mean."""
    codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=dim, codebook=codebook)
    error = (quant.dequantize_asymmetric(codes, scale, zero, dtype=torch.float32, codebook=codebook) - x).pow(2)
    spread = (x - x.mean(dim, keepdim=True)).abs().flatten()
    tail = spread >= spread.kthvalue(max(1, int(spread.numel() * (1 - TAIL)))).values
    return float(error.mean()), float(error.flatten()[tail].mean())


def measure(model, ids: torch.Tensor, spec: str = "int2") -> dict:
    """Per codebook: keys' and values' squared errors (all elements, tail), averaged over the recorded encodes."""
    seen, bits, group = stored_kv(model, ids, spec)
    rows = {}
    for name in quant.CODEBOOKS:
        book = None if name == "uniform" else quant.codebook_levels(bits, group)
        sums = torch.zeros(4, dtype=torch.float64)
        for k, v in seen:
            b, h, n, d = k.shape
            keys = group_errors(k[:, :, : n - n % group].reshape(b, h, -1, group, d), bits, 3, book)
            values = group_errors(v.reshape(b, h, n, d // group, group), bits, -1, book)
            sums += torch.tensor([*keys, *values], dtype=torch.float64)
        keys_all, keys_tail, values_all, values_tail = (sums / len(seen)).tolist()
        rows[name] = {"keys": keys_all, "keys_tail": keys_tail, "values": values_all, "values_tail": values_tail}
    return {"spec": spec, "bits": bits, "group_size": group, "tokens": ids.shape[-1], "encodes": len(seen),
            "tail": TAIL, "codebooks": rows}  # fmt: skip


def table(result: dict) -> str:
    title = (
        f"{result['spec']} ({result['bits']} bits, groups of {result['group_size']}), {result['tokens']} tokens: mean"
        f" squared error, all elements / the {result['tail']:.0%} furthest from their group's mean (x uniform)"
    )
    columns = {"keys": "keys", "keys_tail": "keys, tail", "values": "values", "values_tail": "values, tail"}
    return ratio_table(title, "codebook", columns, result["codebooks"], "uniform")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_flags(parser, 1024, "prefill length (the held-out text's first tokens)")
    parser.add_argument("--spec", default="int2", help="the 4/3/2-bit cache whose storage is measured")
    args = parser.parse_args(argv)
    return run_probe(args, lambda: check_kivi_spec(args.spec), lambda model, ids: measure(model, ids, args.spec), table)
