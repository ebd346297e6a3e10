"""The shared test matrix: cache kinds x model families x attention x batch x decoding modes.

A new cache kind joins by adding one ``CacheCase``; the paged and sliding-window caches add theirs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from models import ATTENTION, FAMILIES

from hf_kvcache.compare import LOGIT_BOUNDS


@dataclass(frozen=True)
class CacheCase:
    id: str
    spec: str  # make_cache spec
    lossless: bool  # must reproduce DynamicCache exactly
    # Lossy kinds: bound on max |logit error| / std(reference logits) under teacher forcing (test_logit_bounds), and
    # whether greedy tokens must match DynamicCache (a flip is allowed only where the reference was nearly tied).
    logit_bound: float = 0.0
    greedy_exact: bool = False
    # Attention implementation the cache runs under instead of the matrix's eager / sdpa (compared with the sdpa
    # reference, once).
    attn: str | None = None
    # Families to run on (None: all). Variants of a kind (another group size, a fixed pool, an int8 window) change
    # storage, not how a family's model uses the cache: they run on a full-attention and a hybrid family.
    families: tuple[str, ...] | None = None


VARIANT = ("llama", "gemma3")

# 4/3/2-bit cases use a small residual and groups so that tokens really are quantized within short test sequences.
CACHE_CASES = [
    CacheCase("int8", "int8", lossless=False, logit_bound=LOGIT_BOUNDS["int8"], greedy_exact=True),
    CacheCase(
        "int8-g8",
        "int8:group_size=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int8"],
        greedy_exact=True,
        families=VARIANT,
    ),
    # fp8 e4m3: 3 mantissa bits per element, a coarser reading than int8's 255 steps of the tiny models' evenly spread
    # K/V, and no full-precision residual: teacher-forced 0.19 x std on gemma3 (int8 0.034, int4 without a residual
    # 0.30), 0.03-0.05 on llama and qwen2. Its bound is int4's; greedy tokens may flip where the reference ties.
    CacheCase("fp8", "fp8", lossless=False, logit_bound=LOGIT_BOUNDS["fp8"]),
    CacheCase("int4", "int4:residual_length=4:group_size=8", lossless=False, logit_bound=LOGIT_BOUNDS["int4"]),
    CacheCase(
        "int3",
        "int3:residual_length=4:group_size=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int3"],
        families=VARIANT,
    ),
    CacheCase("int2", "int2:residual_length=4:group_size=8", lossless=False, logit_bound=LOGIT_BOUNDS["int2"]),
    # KIVI's ablation: keys per token like the values (key_axis=token), encoded one token at a time. Per-token keys
    # lose more than per-channel ones (the paper's point): teacher-forced error 0.23-0.26 x std on gemma3 (int4
    # per-channel: 0.04-0.05), 0.06-0.08 on llama, over 3 seeds; the bound is twice int4's.
    CacheCase(
        "int4-ktok",
        "int4:residual_length=4:group_size=8:key_axis=token",
        lossless=False,
        logit_bound=2 * LOGIT_BOUNDS["int4"],
        families=VARIANT,
    ),
    # Hadamard rotation of the head dimension before quantizing (QuaRot): on tiny random models, which have no
    # outlier channels to spread, it neither helps nor hurts much (teacher-forced int4 0.06-0.07 x std on llama).
    CacheCase(
        "int4-rot",
        "int4:residual_length=4:group_size=8:rotate=hadamard",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int4"],
        families=VARIANT,
    ),
    CacheCase(
        "int2-rot-hf",
        "int2:residual_length=4:group_size=8:rotate=hadamard",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # Keys quantized before RoPE (KVQuant): turned back before encoding, forward when read (Llama and Gemma 3, whose
    # sliding layers have their own rotary base); under hf_kvcache the quantized segment is read by the reference.
    CacheCase(
        "int4-prerope",
        "int4:residual_length=4:group_size=8:pre_rope=true",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int4"],
        families=VARIANT,
    ),
    CacheCase(
        "int2-all-hf",
        "int2:residual_length=4:group_size=8:pre_rope=true:rotate=hadamard:sinks=3",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # The first and last layers in int8, the others in 2 bits: Gemma 3's sliding layers 0 and 2 int8, its full-attention
    # layer 1 int2, each read by its own kernel under hf_kvcache.
    CacheCase(
        "int2-boundary-hf",
        "int2:residual_length=4:group_size=8:boundary_layers=1",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=("gemma3",),
        attn="hf_kvcache",
    ),
    # 4-bit keys beside 2-bit values (with int2's rotation, sinks and pre-RoPE keys): each tile's keys and values
    # unpacked at their own width in one launch under hf_kvcache.
    CacheCase(
        "int2-k4-hf",
        "int2:residual_length=4:group_size=8:key_bits=4",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # The residual in int8: read by the int8 kernel beside the 2-bit codes under hf_kvcache, and by the crop of a
    # partly removed key group (its survivors re-join the int8 residual).
    CacheCase(
        "int2-res8-hf",
        "int2:residual_length=4:group_size=8:residual_bits=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # Lloyd-Max levels instead of the uniform grid (codebook=lloyd): decoded into the workspace under eager / sdpa, each
    # code's level read from its table by the kernels under hf_kvcache (with int3's rotation and pre-RoPE keys).
    CacheCase(
        "int2-lloyd",
        "int2:residual_length=4:group_size=8:codebook=lloyd",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
    ),
    CacheCase(
        "int3-lloyd-hf",
        "int3:residual_length=4:group_size=8:codebook=lloyd",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int3"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # Smoothed keys (smooth): stored times per-pair scales measured at each layer's first encode, read back divided
    # under eager / sdpa, and by the kernels with the query divided under hf_kvcache (over int2's rotation, sinks and
    # pre-RoPE keys; over int3's without pre-RoPE keys, where the scales are per channel).
    CacheCase(
        "int2-smooth",
        "int2:residual_length=4:group_size=8:smooth=1",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
    ),
    CacheCase(
        "int3-smooth-hf",
        "int3:residual_length=4:group_size=8:smooth=0.5:pre_rope=false",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int3"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # 8-bit scales (scale_dtype=e5m3) and int8 zero points: decoded into the workspace under eager / sdpa (over int2's
    # rotation, sinks, pre-RoPE and smoothed keys), read by the kernels under hf_kvcache (per-token keys too).
    CacheCase(
        "int2-e5m3",
        "int2:residual_length=4:group_size=8:scale_dtype=e5m3",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
    ),
    CacheCase(
        "int4-e5m3-hf",
        "int4:residual_length=4:group_size=8:scale_dtype=e5m3",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int4"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # The first real tokens of each row kept in full precision (attention sinks), left padding included: a dense
    # segment before the codes, under sdpa and read in place by the kernels under hf_kvcache.
    CacheCase(
        "int4-sinks",
        "int4:residual_length=4:group_size=8:sinks=3",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int4"],
        families=VARIANT,
    ),
    CacheCase(
        "int2-sinks-hf",
        "int2:residual_length=4:group_size=8:sinks=3",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        families=VARIANT,
        attn="hf_kvcache",
    ),
    # A residual longer than the whole text: nothing is ever quantized, so the cache must be exact.
    CacheCase("int4-resid", "int4:group_size=8:residual_length=1000", lossless=True, families=VARIANT),
    # sinks + window larger than the text: nothing is evicted, so the sink cache must be exact (eviction is tested
    # against explicit attention masks in test_sliding_cache.py).
    CacheCase("sink", "sink:window=256:sinks=4", lossless=True),
    # Paged: blocks of 4 tokens so that short tests cross blocks, share prompt blocks and copy on write.
    CacheCase("paged", "paged:block_size=4", lossless=True),
    CacheCase("paged-fixed", "paged:block_size=5:num_blocks=64", lossless=True, families=VARIANT),
    # The same kinds under the hf_kvcache attention: decode steps read the storage through the kernels (the
    # pure-torch reference on CPU), and must agree with the sdpa reference as the plain cases do.
    CacheCase("paged-hf", "paged:block_size=4", lossless=True, attn="hf_kvcache"),
    CacheCase(
        "int8-hf", "int8", lossless=False, logit_bound=LOGIT_BOUNDS["int8"], greedy_exact=True, attn="hf_kvcache"
    ),
    CacheCase(
        "int4-hf",
        "int4:residual_length=4:group_size=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int4"],
        attn="hf_kvcache",
    ),
    CacheCase(
        "int3-hf",
        "int3:residual_length=4:group_size=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int3"],
        attn="hf_kvcache",
        families=VARIANT,
    ),
    CacheCase(
        "int2-hf",
        "int2:residual_length=4:group_size=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int2"],
        attn="hf_kvcache",
        families=VARIANT,
    ),
    CacheCase("sink-hf", "sink:window=256:sinks=4", lossless=True, attn="hf_kvcache"),
    # int8 pages: the int8 cache's encoding in a block pool (sharing, copy-on-write, beams, crop as with full pages).
    CacheCase(
        "paged-int8",
        "paged:block_size=4:bits=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int8"],
        greedy_exact=True,
        families=VARIANT,
    ),
    CacheCase(
        "paged-int8-hf",
        "paged:block_size=4:bits=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int8"],
        greedy_exact=True,
        attn="hf_kvcache",
        families=VARIANT,
    ),
    CacheCase(
        "sink-int8",
        "sink:window=256:sinks=4:bits=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int8"],
        greedy_exact=True,
        families=VARIANT,
    ),
    CacheCase(
        "sink-int8-hf",
        "sink:window=256:sinks=4:bits=8",
        lossless=False,
        logit_bound=LOGIT_BOUNDS["int8"],
        greedy_exact=True,
        attn="hf_kvcache",
        families=VARIANT,
    ),
]

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3),
    "beam-nrs": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sample-nrs": dict(do_sample=True, num_return_sequences=3),
    "prompt-lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
    "assisted": dict(do_sample=False),  # with the same-family assistant model, added by the test
}
DETERMINISTIC_GREEDY = ("greedy", "prompt-lookup", "assisted")

FAMILY_IDS = list(FAMILIES)
BATCHES = ("single", "padded")


def allowed_modes(batch: str, modes=tuple(MODES)) -> list[str]:
    """The modes transformers supports for ``batch``: assisted and prompt-lookup decoding take batch size 1 only."""
    return [m for m in modes if not (batch == "padded" and m in ("prompt-lookup", "assisted"))]


def matrix(batches=BATCHES, modes=tuple(MODES)) -> list:
    """``pytest.param(case, family, attn, batch, mode)`` over every cache case, family, attention and batch shape
    (none skipped at run time).

    Decoding modes: a case's first family runs every mode under each attention and batch shape; its other families
    run greedy and one more mode each, in turn per batch shape (so each family meets the sampling, beam and
    speculative modes across its attention x batch combinations without the full product: the cache operations a
    mode exercises - reorder, repeat, crop - are the cache's, tested in full on the first family). Left out:
    assisted / prompt-lookup decoding with a padded batch (transformers supports batch size 1 only there), and a case
    with its own attention implementation under anything but the sdpa reference it is compared with. The fast tier
    (the rest is marked slow: the full run only) takes, on the first family, greedy under every attention and batch
    shape and each other mode once under sdpa, on the last batch shape that allows it (padded, but for the speculative
    modes); on the other families a padded batch, greedy under sdpa."""
    last_batch = {mode: [b for b in batches if mode in allowed_modes(b, modes)][-1] for mode in modes}
    params = []
    for case in CACHE_CASES:
        families = case.families or FAMILY_IDS
        turn = dict.fromkeys(batches, 0)
        for family in families:
            for attn in ATTENTION:
                if case.attn and attn != "sdpa":
                    continue
                for batch in batches:
                    allowed = allowed_modes(batch, modes)
                    others = [m for m in allowed if m != "greedy"]
                    if family != families[0] and len(others) > 1:
                        allowed = [m for m in allowed if m == "greedy" or m == others[turn[batch] % len(others)]]
                        turn[batch] += 1
                    for mode in allowed:
                        parts = [case.id, family, attn] + [batch] * (len(batches) > 1) + [mode] * (len(modes) > 1)
                        # the fast tier
                        if family == families[0]:  # every attention greedy, every other mode once under sdpa
                            fast = mode == "greedy" or (attn == "sdpa" and batch == last_batch[mode])
                        else:  # a padded batch, greedy under sdpa
                            fast = (mode, attn, batch) == ("greedy", "sdpa", batches[-1])
                        marks = () if fast else (pytest.mark.slow,)
                        params.append(pytest.param(case, family, attn, batch, mode, id="-".join(parts), marks=marks))
    return params


__all__ = [
    "ATTENTION",
    "BATCHES",
    "CACHE_CASES",
    "DETERMINISTIC_GREEDY",
    "FAMILY_IDS",
    "MODES",
    "CacheCase",
    "matrix",
]
