"""What smoothed keys (``smooth=``) change in attention, layer by layer, against scales fitted to the queries.

One forward records each layer's queries and keys (a recording attention function: post-RoPE queries, keys turned back
to before RoPE as ``pre_rope=True`` stores them). Each layer's keys are then quantized as a 4/3/2-bit cache stores them
(``--bits``: Hadamard-rotated, per channel over groups of ``--group`` tokens, the first 4 tokens exact) after scaling
by: nothing; :func:`hf_kvcache.formats.scaled.smoothing_scales` at each ``--strengths`` (from the keys alone, as the
cache measures them); and the scales an oracle that saw the queries would pick, ``s^4 = E[q^2] / Var k`` per RoPE pair
(it minimizes ``E[(q . dk)^2]`` for isotropic rounding error). Both are measured on the first half of the tokens; the
queries of the second half attend to every earlier token, and the report gives, averaged over layers and heads, the
KL divergence of the quantized keys' attention weights from the exact ones and the relative error of the attention
output (values exact: the keys' share alone).

    python benchmarks/smooth_errors.py --model smollm2 --bits 2
"""

from __future__ import annotations

import argparse

import torch

from .. import quant
from ..formats.rotated import hadamard
from ..formats.scaled import pair_channels, smoothing_scales
from ..rope import RotarySpec, rotary_spec, rotate_positions
from ._probe import add_common_flags, ratio_table, run_probe

__all__ = ["attention_errors", "main", "measure", "record", "quantized_keys"]

SINKS = 4  # exact, as int2 / int3 keep them
RECORDER = "hf_kvcache_record"


def record(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's ``(query, key, value)`` of one forward of ``ids`` (batch 1): ``(Hq, T, D)`` post-RoPE queries and
    ``(Hkv, T, D)`` keys and values, as the attention function receives them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((query[0].detach().float(), key[0].detach().float(), value[0].detach().float()))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(RECORDER, recording)
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDER)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return seen


def quantized_keys(pre: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys ``(H, T, D)`` (before RoPE) times ``scales``, rotated, quantized per channel over groups of ``group``
    tokens after the first :data:`SINKS` (kept exact, with any last partial group), and read back."""
    h = hadamard(pre.shape[-1], torch.float32, pre.device)
    x = (pre * scales[:, None]) @ h
    n = (x.shape[1] - SINKS) // group * group
    body = x[:, SINKS : SINKS + n].unflatten(1, (n // group, group))
    codes, scale, zero = quant.quantize_asymmetric(body, bits, dim=2)
    x[:, SINKS : SINKS + n] = quant.dequantize_asymmetric(codes, scale, zero, dtype=torch.float32).flatten(1, 2)
    return (x @ h) / scales[:, None]


def attention_errors(
    query: torch.Tensor, keys: torch.Tensor, approx: torch.Tensor, value: torch.Tensor, start: int
) -> tuple[float, float]:
    """Mean KL(exact || approx) of the attention weights and mean relative output error of the queries from ``start``
    on, each over every earlier token (``keys`` / ``approx`` post-RoPE, ``(Hkv, T, D)``; grouped query heads)."""
    hq, t, d = query.shape
    groups = hq // keys.shape[0]
    q = query[:, start:].unflatten(0, (keys.shape[0], groups))  # (Hkv, G, n, D)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()[start:]

    def attend(k):
        scores = (q @ k[:, None].transpose(-1, -2)) / d**0.5
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return p, p @ value[:, None]

    (p, out), (p_hat, out_hat) = attend(keys), attend(approx)
    kl = (p * (p.clamp_min(1e-30).log() - p_hat.clamp_min(1e-30).log())).sum(-1).mean()
    error = ((out_hat - out).pow(2).sum(-1) / out.pow(2).sum(-1).clamp_min(1e-30)).mean()
    return float(kl), float(error)


def _query_fitted(query: torch.Tensor, pre: torch.Tensor, spec: RotarySpec | None) -> torch.Tensor:
    """``(E[q^2] / Var k) ** (1 / 4)`` per KV head and channel pair (queries of a head's group pooled), geometric
    mean 1."""
    heads = pre.shape[0]
    energy = query.pow(2).mean(1).unflatten(0, (heads, -1)).mean(1)
    variance = pre.var(1, unbiased=False)
    ratio = pair_channels(energy, spec) / pair_channels(variance, spec).clamp_min(1e-12)
    log_scale = ratio.log() / 4
    return (log_scale - log_scale.mean(-1, keepdim=True)).exp()


def measure(model, ids: torch.Tensor, bits: int = 2, group: int = 64, strengths=(0.5, 1.0, 1.5, 2.0)) -> dict:
    """Per scaling (``none``, ``keys s`` per strength, ``queries``): mean KL and output error over the layers."""
    spec = rotary_spec(model, model.config, way_out="a model with RoPE")
    if spec is None:
        raise ValueError("model: smoothed keys are measured before RoPE; this model has no rotary embedding")
    seen = record(model, ids)
    t = ids.shape[-1]
    start = t // 2
    names = ["none", *(f"keys {s:g}" for s in strengths), "queries"]
    sums = {name: torch.zeros(2, dtype=torch.float64) for name in names}
    for query, key, value in seen:
        pre = rotate_positions(key[None], 0, spec, inverse=True)[0]
        first = pre[:, SINKS:start]
        scalings = {"none": torch.ones(pre.shape[0], pre.shape[-1])}
        for s in strengths:
            scalings[f"keys {s:g}"] = smoothing_scales(first[None], s, spec)[0]
        scalings["queries"] = _query_fitted(query[:, SINKS:start], first, spec)
        for name, scales in scalings.items():
            approx = rotate_positions(quantized_keys(pre, scales, bits, group)[None], 0, spec)[0]
            sums[name] += torch.tensor(attention_errors(query, key, approx, value, start), dtype=torch.float64)
    rows = {name: dict(zip(("kl", "output_error"), (total / len(seen)).tolist())) for name, total in sums.items()}
    return {"bits": bits, "group_size": group, "tokens": t, "layers": len(seen), "scalings": rows}


def table(result: dict) -> str:
    title = (
        f"{result['bits']}-bit keys (Hadamard-rotated, groups of {result['group_size']} tokens), {result['tokens']} "
        f"tokens, {result['layers']} layers: attention of the second half's queries, keys quantized vs exact"
    )
    columns = {"kl": "KL of the weights", "output_error": "output error"}
    return ratio_table(title, "keys scaled by", columns, result["scalings"], "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_flags(parser, 2048, "the held-out text's first tokens")
    parser.add_argument("--bits", type=int, default=2, choices=(4, 3, 2), help="the keys' width")
    parser.add_argument("--group", type=int, default=64, help="tokens per key group")
    args = parser.parse_args(argv)

    def check() -> None:
        if args.group < 1 or args.tokens < 2 * (SINKS + args.group):
            raise ValueError(
                f"--tokens must hold two key groups past the sinks, got {args.tokens} (group {args.group})"
            )

    return run_probe(args, check, lambda model, ids: measure(model, ids, args.bits, args.group), table)
