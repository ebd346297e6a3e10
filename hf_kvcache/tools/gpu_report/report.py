"""The GPU decode path, measured on a machine without a GPU: what a report on CPU can say for sure, and an estimate.

Deterministic (no GPU needed, the same numbers on every run):

1. Every Triton decode-kernel variant (dense, int8, KIVI int4/int3/int2, paged, paged int8; 1, 4 and 16 query tokens;
   head_dim 64, 128 and 96; with and without left padding), compiled ahead of time for sm_80 and sm_90 with Triton's
   bundled ptxas, from the exact specialization a real launch gets: a decode step of the real cache runs on CPU at
   the Llama-3-8B attention shape (32 query / 8 KV heads, bfloat16) and each launch is intercepted (see
   ``_gpu_aot``). Per variant: registers, spills, shared memory, resident blocks per SM, waves at 4k x 1, 16k x 8 and
   32k x 8, SASS instructions per warp in the main loop (per 64 tokens: one tile per iteration, KIVI's tiles being
   one key group, scaled to 64 tokens where a group is smaller) and bytes read.
2. Kernel launches per layer per decode step for every cache under the ``hf_kvcache`` attention and for
   ``DynamicCache`` under sdpa, counted with a ``TorchDispatchMode`` over decode steps of a tiny Llama (the rule is
   :func:`counts_as_launch`); the distinct compiled variants 100 decode steps of varying length and padding produce.

Measured on this machine (not deterministic, left out of the comparison of two runs): host microseconds per layer
and decode step.

Estimated (labelled so everywhere): each kernel's time against sdpa over bfloat16 on an H100 and an A100, from the
roofline model written out in :data:`MODEL`.

    python benchmarks/gpu_report.py --output results/gpu-report    # everything (~5 min on 2 CPU cores, cold cache)
    python benchmarks/gpu_report.py --output /tmp/r --quick        # a representative subset (CI, the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from . import aot

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

# name -> cache spec; "dense" is the sink cache with a window longer than any prompt here (all of its segments dense).
KINDS = {
    "dense": "sink:window=4096",
    "int8": "int8",
    # int4 as a user gets it: Hadamard-rotated codes (the rotation folded into the query and the output), 4 sinks
    "int4": "int4",
    # int3 / int2 as a user gets them: Hadamard-rotated codes, keys quantized before RoPE, 4 sinks (each key tile
    # rotated back and turned in the launch)
    "int3": "int3",
    "int2": "int2",
    "int4 KIVI layout": "int4:rotate=none:sinks=0",  # KIVI's plain codes, the kernel's simplest KIVI loop
    "int4 pre-RoPE": "int4:rotate=none:sinks=0:pre_rope=true",  # KIVI's codes, each key turned per element
    "paged": "paged",
    "paged int8": "paged:bits=8",
    "fp8": "fp8",
    "int2 k4": "int2:key_bits=4",  # 4-bit keys beside 2-bit values (int3's bytes), int2's options
    "int2 16-bit scales": "int2:scale_dtype=none",  # int2's scales and zero points in the K/V dtype, not 8-bit
    "int2 int8 residual": "int2:residual_bits=8",  # int2's residual in rotated int8, not the K/V dtype
}
STORAGE = {"dense": "DenseSegment", "int8": "Int8Segment", "fp8": "Fp8Segment"}
STORAGE |= dict.fromkeys((kind for kind in KINDS if kind.split()[0] in ("int4", "int3", "int2")), "KiviSegment")
STORAGE |= {"paged": "PagedSegment", "paged int8": "PagedSegment"}
Q_LENS = (1, 4, 16)
HEAD_DIMS = (64, 128, 96)
SHAPES = (("4k x 1", 4096, 1), ("16k x 8", 16384, 8), ("32k x 8", 32768, 8))  # (label, tokens, batch)
PROMPT = 203  # tokens before the captured step: a length that is not a multiple of 16, as most decode steps are
PAD = 7  # left padding of row 0 in the padded variants

# The estimate's device constants: peak HBM bandwidth (the issue's figures), SMs, boost clock (SXM parts).
GPUS = {
    90: {"name": "H100 SXM", "bandwidth": 3.35e12, "sms": 132, "clock": 1.98e9},
    80: {"name": "A100 SXM", "bandwidth": 2.0e12, "sms": 108, "clock": 1.41e9},
}
LAUNCH_FLOOR_US = 2.0  # an assumed GPU-side floor per small kernel (launch + ramp), when the host keeps up
MODEL = f"""\
Estimate (a roofline model, not a measurement). Per layer and decode step, for a kernel variant at T tokens x B rows:

  programs   = B * H_kv * splits,  splits = hf_kvcache.kernels.torch_decode.num_splits(T, B * H_kv) (as on CUDA)
  tiles      = ceil(ceil(T / splits) / 64)                  64-token tiles walked by one program
  t_memory   = bytes / (BW * min(1, programs / SMs))        bytes: the cache's stored bytes for T tokens
                                                            (hf_kvcache.plan.kv_bytes) + the bool mask B*q*T
  t_issue    = ceil(programs / SMs) * tiles * warps * loop_instr / (4 * clock)
                                                            4 warp-instructions per SM per clock, SASS main loop
  t_kernel   = max(t_memory, t_issue)
  t_sdpa     = bytes_bf16 / BW                              DynamicCache's bfloat16 K/V read once, ideal (GQA path)
  ratio      = t_sdpa / t_kernel                            > 1: faster than sdpa
  layer-step = t_kernel + launches * {LAUNCH_FLOOR_US} us vs t_sdpa + launches_sdpa * {LAUNCH_FLOOR_US} us

BW, SMs, clock: H100 SXM 3.35 TB/s, 132 SMs, 1.98 GHz; A100 SXM 2.0 TB/s, 108 SMs, 1.41 GHz. The model ignores
latency: t_issue assumes every scheduler issues every clock, which one resident warp per scheduler (blocks/SM x
warps / 4 = 1) cannot do across dependent instructions, and t_memory assumes enough loads in flight, so both are
lower bounds on time and the ratios upper bounds on speed-up; it also ignores L2 hits,
the split-combine and the other segments' launches (counted in the layer-step line only), and the host: without
CUDA graphs a decode step is host-bound when host time per layer exceeds the GPU time."""


# --- a decode step of a real cache, on CPU, with the kernel launches intercepted -----------------------------------


def _model(head_dim: int, layers: int = 1, heads: tuple[int, int] = (32, 8), hidden: int = 64):
    """A random Llama with the given attention shape (bfloat16), a small hidden size: only the attention matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_kvcache  # noqa: F401  (registers the attention)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=head_dim,
        max_position_embeddings=65536,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation("hf_kvcache")
    return model


@contextlib.contextmanager
def _intercepted(launches: list):
    """Route every segment of the ``hf_kvcache`` attention to the Triton launch (intercepted, with the split count
    the CUDA path computes) instead of the CPU reference; the attention then returns zeros."""
    from hf_kvcache import attention
    from hf_kvcache.formats import segment_inputs
    from hf_kvcache.kernels.torch_decode import num_splits

    def decode_attention(query, handle, mask, scaling, softcap=0.0, sinks=None):
        b, hq, q, _ = query.shape
        for segment, part_mask, _ in segment_inputs(query, handle, mask):
            splits = num_splits(segment.length, b * segment.heads)
            launch = aot.launch_partial(query, segment, part_mask, scaling, softcap, splits)
            if launch is not None:  # None: a segment the kernel does not read (the reference serves it inside the op)
                launches.append(launch)
        return query.new_zeros((b, q, hq, handle.value_dim))

    original = attention.decode_attention
    attention.decode_attention = decode_attention
    try:
        with aot.capturing():
            yield launches
    finally:
        attention.decode_attention = original


def _mask(batch: int, total: int, pads: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, total, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


def capture_steps(model, spec: str, prompt: int, pads: list[int], q_len: int, steps: int) -> list[list]:
    """Launches of each of ``steps`` decode forwards (``q_len`` new tokens each) after a ``prompt``-token prefill."""
    from hf_kvcache import make_cache
    from hf_kvcache._compat import with_cache

    batch = len(pads)
    cache = make_cache(spec, model)
    ids = torch.randint(3, 128, (batch, prompt))
    out = []
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=_mask(batch, prompt, pads), **with_cache(model, cache), use_cache=True)
        total = prompt
        for _ in range(steps):
            total += q_len
            new = torch.randint(3, 128, (batch, q_len))
            launches: list = []
            with _intercepted(launches):
                mask = _mask(batch, total, pads)
                model(input_ids=new, attention_mask=mask, **with_cache(model, cache), use_cache=True)
            out.append(launches)
    return out


# --- 1. the variants, compiled ---------------------------------------------------------------------------------


def variant_grid(quick: bool) -> list[dict]:
    if quick:
        return [dict(kind=k, head_dim=128, q_len=1, padded=True) for k in KINDS]
    return [
        dict(kind=k, head_dim=d, q_len=q, padded=p)
        for k in KINDS
        for d in HEAD_DIMS
        for q in Q_LENS
        for p in (False, True)
    ]


def _main_launch(kind: str, launches: list):
    """The launch over the storage's history: the longest segment of the kind's storage type."""
    mine = [x for x in launches if x.segment == STORAGE[kind]]
    return max(mine, key=lambda x: x.bound["T"]) if mine else None


def _bytes(spec: str, head_dim: int, tokens: int, batch: int, q_len: int, mask: bool) -> int:
    """Bytes a decode step of one layer reads: the cache's stored bytes (its own plan) and the bool mask."""
    from transformers import LlamaConfig

    from hf_kvcache.plan import kv_bytes

    config = LlamaConfig(
        num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=head_dim
    )
    if spec.startswith("sink"):
        spec = "dynamic"  # the dense kernel over a whole bfloat16 history reads what DynamicCache stores
    stored = kv_bytes(spec, config, tokens=tokens, batch=batch)
    return stored + (batch * q_len * (tokens + q_len) if mask else 0)


def _waves_and_tiles(tokens: int, batch: int) -> tuple[int, int]:
    from hf_kvcache.kernels.torch_decode import num_splits

    splits = num_splits(tokens, batch * 8)
    per_split = -(-tokens // splits)  # as triton_partial: ceil(T / splits), rounded up to whole 64-token tiles
    return batch * 8 * splits, -(-per_split // 64)


def compile_variants(grid: list[dict], log) -> tuple[list[dict], dict]:
    """Capture each variant's decode step, compile every distinct launch for both targets, one row per (variant,
    arch) for the main launch; ``findings`` collects what does not compile or fit."""
    rows, compiled, findings = [], {}, {}
    models = {}
    for v in grid:
        model = models.get(v["head_dim"]) or models.setdefault(v["head_dim"], _model(v["head_dim"]))
        pads = [PAD, 0] if v["padded"] else [0, 0]
        name = f"{v['kind']} D={v['head_dim']} q={v['q_len']}{' padded' if v['padded'] else ''}"
        try:
            (launches,) = capture_steps(model, KINDS[v["kind"]], PROMPT, pads, v["q_len"], 1)
        except Exception as err:  # a variant the cache or kernel refuses: a finding, not a crash
            findings[name] = f"decode step failed: {type(err).__name__}: {err}"
            log(f"  {name}: {findings[name]}")
            continue
        main = _main_launch(v["kind"], launches)
        if main is None:
            findings[name] = (
                f"no {STORAGE[v['kind']]} launch in the step: the Triton kernel does not read it, the reference serves "
                f"it inside the op (launches: {[x.segment for x in launches]})"
            )
            continue
        for launch in launches:
            for arch in aot.TARGETS:
                key = (launch.key, arch)
                if key not in compiled:
                    try:
                        compiled[key] = aot.compile_launch(launch, arch).row()
                    except Exception as err:
                        compiled[key] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
                        findings[f"{name} sm_{arch} {launch.segment}"] = compiled[key]["error"]
        constexprs = main.constexprs()
        for arch in aot.TARGETS:
            c = compiled[(main.key, arch)]
            row = {**v, "arch": arch, "segment": main.segment, "launches": len(launches), **c}
            row["block_dk"], row["block_dv"] = constexprs["BLOCK_DK"], constexprs["BLOCK_DV"]
            row["block_n"] = constexprs["BLOCK_N"]
            if c.get("loop_instructions") and row["block_n"] != 64:  # KIVI tiles are one key group: per 64 tokens
                row["loop_instructions"] = round(c["loop_instructions"] * 64 / row["block_n"])
                row["loop_ops"] = {op: round(n * 64 / row["block_n"]) for op, n in c["loop_ops"].items()}
            row["rows"], row["block_r"] = main.bound["G"] * v["q_len"], constexprs["BLOCK_R"]
            row["specialized"] = _specialized(main)
            row["variant"] = hashlib.sha1(main.key.encode()).hexdigest()[:10]  # Triton's cache key, shortened
            if "error" not in c:
                for label, tokens, batch in SHAPES:
                    programs, _ = _waves_and_tiles(tokens, batch)
                    slots = c["blocks_per_sm"] * GPUS[arch]["sms"]
                    row[f"waves {label}"] = round(programs / slots, 2) if slots else None
                    row[f"MB read {label}"] = round(
                        _bytes(KINDS[v["kind"]], v["head_dim"], tokens, batch, v["q_len"], True) / 1e6, 2
                    )
            rows.append(row)
        log(f"  {name}: {len(launches)} launches, {sum(1 for k in compiled)} compiled so far")
    return rows, findings


def derived_findings(rows: list[dict]) -> dict:
    """What the compiled grid says beyond its rows: kernels that cannot launch, head_dim 96 against 128, padding."""
    out = {}
    for kind in KINDS:
        for arch in aot.TARGETS:
            mine = [r for r in rows if r["kind"] == kind and r["arch"] == arch and "error" not in r]
            over = [r for r in mine if not r["fits"]]
            if over:
                dims = sorted({r["head_dim"] for r in over})
                smem = sorted({r["shared"] for r in over})
                out[f"{kind} on sm_{arch}"] = (
                    f"does not launch in {len(over)} of {len(mine)} variants (head_dim {', '.join(map(str, dims))}): "
                    f"{smem[0]:,} to {smem[-1]:,} B of shared memory, over the "
                    f"{aot.SM_LIMITS[arch].smem_per_block:,} B a block may have (OutOfResources at launch)"
                )
    padded_rows = sorted({(r["rows"], r["block_r"]) for r in rows if "block_r" in r and r["rows"] < r["block_r"]})
    if padded_rows:
        out["query rows"] = (
            "a program computes BLOCK_R = max(8, next_power_of_2(G * q_len)) rows (tensor cores pad smaller products "
            f"themselves) for G * q_len real ones: {', '.join(f'{a} of {b}' for a, b in padded_rows)} at 32/8 heads, "
            "so part of the softmax math in the loop works on padding rows"
        )
    spilling = [r for r in rows if r.get("spill_stores") and r["q_len"] in (1, 4)]
    if spilling:
        where = sorted({(r["kind"], r["arch"]) for r in spilling}, key=lambda k: (list(KINDS).index(k[0]), k[1]))
        out["spills at q_len 1 and 4"] = (
            f"{len(spilling)} of {sum(1 for r in rows if r['q_len'] in (1, 4))} variants spill registers to local "
            f"memory: {', '.join(f'{k} sm_{a}' for k, a in where)}"
        )
    key = {(r["kind"], r["head_dim"], r["q_len"], r["padded"], r["arch"]): r.get("variant") for r in rows}
    same = [k for k in key if k[1] == 96 and key[k] == key.get((k[0], 128, *k[2:]))]
    if same:
        kinds = sorted({k[0] for k in same}, key=list(KINDS).index)
        out["head_dim 96"] = (
            f"compiles; for {', '.join(kinds)} to the very binary of head_dim 128 ({len(same)} of "
            f"{sum(1 for k in key if k[1] == 96)} variants; the others differ by a group-size constant): D is a "
            "runtime argument and BLOCK_D = next_power_of_2(96) = 128, so a quarter of every tile's channels are "
            "masked loads and idle dot-product lanes"
        )
    pairs = [k for k in key if k[3] and (*k[:3], False, k[4]) in key]
    differ = [k for k in pairs if key[k] != key[(*k[:3], False, k[4])]]
    if pairs:
        why = (
            "the mask's alignment or presence follows the padding"
            if differ
            else "padded and unpadded steps share one kernel (padding changes the mask's contents, not the build)"
        )
        out["left padding"] = f"changes the specialization in {len(differ)} of {len(pairs)} variants: {why}"
    return out


def length_specialization(log) -> list[dict]:
    """Main-loop instructions (sm_90) of each kind at the 8B shape when the step's length is a multiple of 16 and when
    it is not (15 steps in 16): Triton specializes the length argument ``T`` on divisibility by 16."""
    out = []
    model = _model(128)
    for kind, spec in KINDS.items():
        row, found = {"kind": kind}, {}
        for prompt in range(PROMPT, PROMPT + 16):  # the first step of each kind of length
            (launches,) = capture_steps(model, spec, prompt, [PAD, 0], 1, 1)
            main = _main_launch(kind, launches)
            found.setdefault(main.bound["T"] % 16 == 0, main)
            if len(found) == 2:
                break
        for divisible, label in ((True, "T%16=0"), (False, "T%16!=0")):
            main = found.get(divisible)
            c = aot.compile_launch(main, 90) if main else None
            row[f"T ({label})"] = main.bound["T"] if main else "never"
            row[f"registers ({label})"] = c.registers if c else ""
            per_64 = 64 / main.constexprs()["BLOCK_N"] if main else 1  # per 64 tokens, as the summary counts
            row[f"loop ({label})"] = round(c.loop_instructions * per_64) if c else ""
        out.append(row)
        log(f"  length specialization: {kind}")
    return out


def _specialized(launch) -> str:
    """Integer arguments the binder turned into constants (=1) or marked divisible by 16 (D), compactly."""
    ones = [n for n, (k, v) in zip(launch.bound, launch.specialization) if k == "constexpr" and n[0].islower()]
    div = [n for n, (k, v) in zip(launch.bound, launch.specialization) if k.startswith("i") and v == "D"]
    return f"=1: {','.join(ones) or '-'}; %16: {','.join(n for n in div if not n.startswith('s')) or '-'}"


# --- around the decode kernel: the split reduction and the append, at the 8B shape ------------------------------


def helper_launches() -> list[tuple[str, object]]:
    """The launches of the kernels around decode attention at the 8B shape (16k tokens x batch 8, bfloat16), as the
    cache and attention issue them per layer-step: the split reduction over the history's splits and the new token's,
    and the new token stored (int8 codes into a layer's buffers, into int8 pages, bfloat16 into pages); and, every
    ``group`` steps, a KIVI cache's oldest residual tokens encoded into its storage (4, 3 and 2 bits, groups of 64)."""
    from hf_kvcache.formats import KiviCodec
    from hf_kvcache.kernels.torch_decode import num_splits
    from hf_kvcache.kernels.triton_append import triton_append, triton_kivi_encode

    decode = aot.kernel_module()
    b, hkv, g, d, tokens, bs = 8, 8, 4, 128, 16384, 16
    splits = num_splits(tokens, b * hkv)
    part = lambda s: (torch.empty(b, hkv, g, 1, s), torch.empty(b, hkv, g, 1, s), torch.empty(b, hkv, g, 1, s, d))  # noqa: E731
    k = torch.empty(b, hkv, 1, d, dtype=torch.bfloat16)
    codes = torch.empty(b, hkv, tokens + 64, d, dtype=torch.int8)[:, :, tokens : tokens + 1]
    scales = torch.empty(b, hkv, tokens + 64, 1)[:, :, tokens : tokens + 1]
    slots = b * tokens + bs
    table = torch.arange(b * (tokens // bs + 1), dtype=torch.int32).view(b, -1)
    pool8, pool_s = torch.empty(slots, hkv, d, dtype=torch.int8), torch.empty(slots, hkv)
    pool = torch.empty(slots, hkv, d, dtype=torch.bfloat16)
    calls = [
        (
            f"combine ({splits} + 1 splits, 2 segments)",
            lambda: decode.triton_combine([part(splits), part(1)], None, torch.bfloat16),
        ),
        ("append int8 (token buffers)", lambda: triton_append(k, k, codes, codes, scales, scales)),
        ("append int8 pages", lambda: triton_append(k, k, pool8, pool8, pool_s, pool_s, table, tokens, bs)),
        ("append pages (bfloat16)", lambda: triton_append(k, k, pool, pool, None, None, table, tokens, bs)),
    ]
    group = 64  # the default at head_dim 128
    flushed = torch.empty(b, hkv, group, d, dtype=torch.bfloat16)
    for bits in (4, 3, 2):
        codec = KiviCodec(bits, group, None)
        out = {  # the slots of the storage's next key group, strided as in a layer's buffers
            name: t.new_empty((b, hkv, (tokens + 2 * group) // codec.units[name], *t.shape[3:]))[
                :, :, tokens // codec.units[name] : (tokens + group) // codec.units[name]
            ]
            for name, t in codec.like(flushed, flushed).items()
        }
        encode = lambda out=out, bits=bits: triton_kivi_encode(flushed, flushed, out, bits, bits, group)  # noqa: E731
        calls.append((f"KIVI encode {bits}-bit ({group} tokens)", encode))
    out = []
    for name, call in calls:
        with aot.capturing() as captured:
            call()
        out.append((name, captured[-1]))
    return out


def compile_helpers(log) -> list[dict]:
    rows = []
    for name, launch in helper_launches():
        for arch in aot.TARGETS:
            c = aot.compile_launch(launch, arch).row()
            rows.append({"kernel": name, "grid": "x".join(map(str, launch.grid))} | c)
        log(f"  {name}: compiled")
    return rows


# --- 2. launches, host time, compiled variants over 100 steps ----------------------------------------------------

_NOT_KERNELS = {
    # allocation without initialization, metadata, no-ops
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "detach", "alias",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    "resize_", "set_", "record_stream", "_local_scalar_dense", "is_nonzero", "equal",
}  # fmt: skip
_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique_consecutive"}


def counts_as_launch(func, out) -> bool:
    """An op that reaches the dispatcher (aten or one of our custom ops; ``linear`` and sdpa arrive whole: one GEMM,
    one attention kernel on CUDA) is one kernel launch unless it is a view or alias (its schema says its output
    aliases an input), an allocation without initialization, metadata, a device-to-host scalar read (counted as a
    sync instead), or all its tensor outputs are empty (aten returns before launching)."""
    name = func._schema.name.split("::")[-1]
    if name in _NOT_KERNELS or func.is_view:
        return False
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return False
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return not tensors or any(t.numel() for t in tensors)


class LaunchCounter:
    """A ``TorchDispatchMode`` counting would-be kernel launches, per decoder layer (module hooks set the current one)
    and outside the layers, and host syncs (``item()``-like reads and ``Tensor.tolist`` calls)."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._schema.name.split("::")[-1]
                if name in _SYNCS:
                    counter.syncs += 1
                if counts_as_launch(func, out):
                    counter.launches[counter.where] = counter.launches.get(counter.where, 0) + 1
                    counter.ops[func._schema.name] = counter.ops.get(func._schema.name, 0) + 1
                return out

        self.mode = Mode()
        self.model = model
        self.where = "outside"
        self.launches: dict = {}
        self.ops: dict = {}
        self.syncs = 0

    @contextlib.contextmanager
    def count(self):
        from hf_kvcache.kernels._eager import through_ops

        handles = []
        for i, layer in enumerate(self.model.model.layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "where", i)))
            handles.append(layer.register_forward_hook(lambda m, a, o: setattr(self, "where", "outside")))
        tolist = torch.Tensor.tolist

        def counted_tolist(t):
            self.syncs += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        try:
            with through_ops(), self.mode:  # each of our kernels one op, as on CUDA (not its CPU reference's)
                yield self
        finally:
            torch.Tensor.tolist = tolist
            for h in handles:
                h.remove()


def count_launches(spec: str, padded: bool, steps: int, layers: int = 2) -> dict:
    """Per decode step (median and max over ``steps``): launches per decoder layer, outside the layers, host syncs;
    and the median host time per layer-step (one thread, this CPU)."""
    from hf_kvcache import make_cache
    from hf_kvcache._compat import with_cache

    model = _model(16, layers=layers, heads=(4, 2), hidden=64)
    if spec == "dynamic":
        model.set_attn_implementation("sdpa")
    pads = [PAD, 0] if padded else [0, 0]
    # KIVI (residual 128, key groups of 16) holds one encoded group after the prompt and flushes within 16 steps
    batch, prompt = len(pads), 150
    cache = make_cache(spec, model)
    per_layer, outside, syncs, seconds, ops = [], [], [], [], {}
    with torch.inference_mode():
        model(input_ids=torch.randint(3, 128, (batch, prompt)), attention_mask=_mask(batch, prompt, pads),
              **with_cache(model, cache))  # fmt: skip
        total = prompt
        for step in range(2 * steps):
            total += 1
            kwargs = dict(input_ids=torch.randint(3, 128, (batch, 1)), attention_mask=_mask(batch, total, pads))
            if step % 2:  # alternate: a timed step, a counted step
                counter = LaunchCounter(model)
                with counter.count():
                    model(**kwargs, **with_cache(model, cache))
                per_layer.append(sum(v for k, v in counter.launches.items() if k != "outside") / layers)
                outside.append(counter.launches.get("outside", 0))
                syncs.append(counter.syncs)
                for k, v in counter.ops.items():
                    ops[k] = max(ops.get(k, 0), v)
            else:
                start = time.perf_counter()
                model(**kwargs, **with_cache(model, cache))
                seconds.append(time.perf_counter() - start)
    return {
        "launches_per_layer": statistics.median(per_layer),
        "launches_per_layer_max": max(per_layer),
        "launches_outside_layers": statistics.median(outside),
        "host_syncs_per_step": statistics.median(syncs),
        "ops_per_step": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12]),
        "host_us_per_layer_step": round(statistics.median(seconds) / layers * 1e6, 1),
    }


def count_variants(kind: str, steps: int) -> dict:
    """Distinct kernel specializations (Triton's cache key) over ``steps`` decode steps at the 8B attention shape:
    four runs of varying prompt length and left padding, one token per step; per segment kind, and apart for the
    unpadded runs, whose one-token steps read no mask (``HAS_MASK`` is a compile-time switch)."""
    model = _model(128)
    runs = [(203, [0, 0]), (260, [5, 0]), (333, [0, 3]), (450, [11, 2])]  # past int4/int2's 128-token residual
    keys: dict[str, set] = {}
    per_run = -(-steps // len(runs))
    for prompt, pads in runs:
        for launches in capture_steps(model, KINDS[kind], prompt, pads, 1, per_run):
            for launch in launches:
                name = launch.segment + ("" if launch.constexprs().get("HAS_MASK") else " (no mask)")
                keys.setdefault(name, set()).add(launch.key)
    return {"steps": per_run * len(runs), "variants": sum(len(v) for v in keys.values())} | {
        f"variants {segment}": len(v) for segment, v in sorted(keys.items())
    }


# --- 3. the estimate ---------------------------------------------------------------------------------------------


def estimate(rows: list[dict], launches: dict) -> list[dict]:
    """The roofline model of :data:`MODEL` for the 8B shape (head_dim 128, padded mask), 1 query token."""
    out = []
    sdpa_launches = launches.get(("dynamic", True), {}).get("launches_per_layer", 0)
    for row in rows:
        if row["head_dim"] != 128 or row["q_len"] != 1 or not row["padded"] or "error" in row:
            continue
        if not row["fits"]:
            out += [{"kind": row["kind"], "gpu": GPUS[row["arch"]]["name"], "shape": s[0], "bound": "does not launch"}
                    for s in SHAPES]  # fmt: skip
            continue
        gpu = GPUS[row["arch"]]
        ours = launches.get((KINDS[row["kind"]], True), {}).get("launches_per_layer", 0)
        for label, tokens, batch in SHAPES:
            programs, tiles = _waves_and_tiles(tokens, batch)
            nbytes = _bytes(KINDS[row["kind"]], 128, tokens, batch, 1, True)
            t_mem = nbytes / (gpu["bandwidth"] * min(1.0, programs / gpu["sms"]))
            instr = row["loop_instructions"] or 0
            t_issue = math.ceil(programs / gpu["sms"]) * tiles * row["warps"] * instr / (4 * gpu["clock"])
            t_kernel = max(t_mem, t_issue)
            t_sdpa = _bytes("dynamic", 128, tokens, batch, 1, False) / gpu["bandwidth"]
            floor = LAUNCH_FLOOR_US * 1e-6
            out.append(
                {
                    "kind": row["kind"],
                    "gpu": gpu["name"],
                    "shape": label,
                    "bound": "memory" if t_mem >= t_issue else "issue",
                    "kernel_us": round(t_kernel * 1e6, 1),
                    "sdpa_us": round(t_sdpa * 1e6, 1),
                    "ratio": round(t_sdpa / t_kernel, 2),
                    "layer_step_ratio": round((t_sdpa + sdpa_launches * floor) / (t_kernel + ours * floor), 2),
                }
            )
    return out


# --- the report --------------------------------------------------------------------------------------------------


def _table(rows: list[dict], columns: list[str]) -> str:
    from tabulate import tabulate

    return tabulate([[r.get(c, "") for c in columns] for r in rows], headers=columns, tablefmt="github")


def summary(report: dict) -> list[dict]:
    """The before / after summary table: per kind at the 8B shape (head_dim 128, one query token, padded batch)."""
    launches = {(r["cache"], r["padded"]): r for r in report["launches"]}
    ratios = {(e["kind"], e["gpu"]): e for e in report["estimate"] if e["shape"] == "16k x 8"}
    out = []
    for r in report["variants"]:
        if r["head_dim"] != 128 or r["q_len"] != 1 or not r["padded"] or "error" in r:
            continue
        est = ratios.get((r["kind"], GPUS[r["arch"]]["name"]), {})
        out.append(
            {
                "kind": r["kind"],
                "arch": f"sm_{r['arch']}",
                "regs": r["registers"],
                "spills (B)": r["spill_stores"],
                "smem (KB)": round(r["shared"] / 1024, 1),
                "blocks/SM": r["blocks_per_sm"],
                "warps/scheduler": r["blocks_per_sm"] * r["warps"] / 4,
                "loop instr/tile": r["loop_instructions"],
                "launches/layer-step": launches.get((r["kind"], True), {}).get("launches_per_layer", ""),
                "est. vs sdpa 16k x 8": est.get("ratio", est.get("bound", "")),
            }
        )
    base = launches.get(("DynamicCache", True))
    if base:
        out.append({"kind": "DynamicCache + sdpa", "launches/layer-step": base["launches_per_layer"]})
    return out


# SASS opcode classes of the main-loop mix (the rest is "other").
OP_CLASSES = {
    "global loads": ("LDG", "LDGSTS"),
    "shared loads": ("LDS", "LDSM"),
    "spill ld/st": ("LDL", "STL"),
    "tensor core": ("HMMA",),
    "int / address": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "PRMT", "SGXT", "IABS", "IMNMX", "UIADD3", "UIMAD"),
    "conversions": ("I2F", "I2FP", "F2FP", "F2I", "F2F"),
    "shuffles": ("SHFL",),
    "fp32 math": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "FCHK"),
    "compare / select": ("ISETP", "SEL", "PLOP3", "P2R", "R2P", "UISETP", "USEL"),
}


def instruction_mix(report: dict) -> list[dict]:
    """The main loop's SASS instructions by class, per kind at the 8B shape (head_dim 128, q 1, padded)."""
    out = []
    for r in report["variants"]:
        if r["head_dim"] != 128 or r["q_len"] != 1 or not r["padded"] or not r.get("loop_ops"):
            continue
        row = {"kind": r["kind"], "arch": f"sm_{r['arch']}", "total": r["loop_instructions"]}
        for name, ops in OP_CLASSES.items():
            row[name] = sum(r["loop_ops"].get(op, 0) for op in ops)
        row["other"] = row["total"] - sum(row[name] for name in OP_CLASSES)
        out.append(row)
    return out


BEFORE = Path(__file__).resolve().parents[3] / "docs" / "data" / "gpu-report-before.json"
COMPARED = ("regs", "spills (B)", "smem (KB)", "blocks/SM", "loop instr/tile", "launches/layer-step")


def before_after(rows: list[dict], before: dict) -> list[dict]:
    """Each summary row (:func:`summary`) as ``before -> after`` where a figure changed (the issue's closing table)."""
    old = {(r["kind"], r.get("arch")): r for r in before["summary"]}
    out = []
    for row in rows:
        prev = old.get((row["kind"], row.get("arch")), {})
        cells = {"kind": row["kind"], "arch": row.get("arch", "")}
        for name in (*COMPARED, "est. vs sdpa 16k x 8"):
            a, b = prev.get(name, ""), row.get(name, "")
            cells[name] = f"{a} → {b}" if a != b and a != "" else str(b)
        out.append(cells)
    return out


def measured_vs_estimate(report: dict, runs: dict[str, dict]) -> list[dict]:
    """The saved GPU runs' kernel times (``docs/results/gpu-run-*.json``, stage ``kernels``: every launch of a real
    layer's decode step, timed on the device) next to this report's sm_90 estimate for the same kind and shape: the
    estimate's layer-step ratio (kernel plus its launches' floor) against the measured speed-up over sdpa, and how
    far the model is off (measured over estimated). Runs that also timed each step as a CUDA-graph replay (the
    device alone: a short step is issued in several times its kernels' time) are compared on that."""
    labels = {(tokens, batch): label for label, tokens, batch in SHAPES}
    estimates = {(e["kind"], e["shape"]): e for e in report["estimate"] if e["gpu"] == GPUS[90]["name"]}
    out = []
    for name, run in sorted(runs.items()):
        stage = run.get("results", {}).get("kernels", {})
        device = run.get("results", {}).get("env", {}).get("info", {}).get("device_name", "?")
        for item in stage.get("items", []):
            label = labels.get((item.get("context"), item.get("batch")))
            est = estimates.get((item.get("kind"), label))
            if est is None or "speedup_vs_sdpa" not in item or "layer_step_ratio" not in est:
                continue
            device_only = item.get("graph_speedup_vs_sdpa")
            got = device_only if device_only is not None else item["speedup_vs_sdpa"]
            out.append({"run": name, "device": device, "kind": item["kind"], "shape": label,
                        "measured_us": round(item["median_us"], 1),
                        "measured_vs_sdpa": round(item["speedup_vs_sdpa"], 2),
                        "device_us": round(item["graph_us"], 1) if "graph_us" in item else "n/a",
                        "device_vs_sdpa": round(device_only, 2) if device_only is not None else "n/a",
                        "estimated_vs_sdpa": est["layer_step_ratio"],
                        "measured_over_estimate": round(got / est["layer_step_ratio"], 2)})  # fmt: skip
    return out


def render(report: dict, runs: dict[str, dict] | None = None) -> str:
    tools = report["toolchain"]
    rows = summary(report)
    lines = [
        "# GPU report (CPU-only: compiled for sm_80 / sm_90, counted on CPU; times are estimates)",
        "",
        f"Command: `{report['command']}`. Triton {report['triton']}, torch {report['torch']}; ptxas "
        f"{', '.join(f'sm_{a}: {Path(p).name}' for a, p in tools['ptxas'].items())}; SASS from "
        f"{'cuobjdump' if tools['cuobjdump'] else 'none (PTX counted)'}.",
        "",
        "## Summary (Llama-3-8B attention: 32 query / 8 KV heads, head_dim 128, bfloat16; one query token)",
        "",
        f"Each kernel compiled from the specialization of a real launch: one decode step of the real cache after a "
        f"{PROMPT}-token prompt, batch 2, row 0 left-padded by {PAD} tokens. `loop instr/tile`: SASS instructions per "
        "warp in the main loop per 64 tokens (one tile per iteration; a KIVI tile is one key group). "
        "`est. vs sdpa`: the roofline estimate below "
        "(> 1 is faster than sdpa over bfloat16), not a measurement.",
        "",
        _table(rows, list(rows[0]) if rows else []),
        "",
    ]
    compared = measured_vs_estimate(report, runs or {})
    if compared:
        lines += [
            "## Measured on a GPU, next to the estimate",
            "",
            "The [GPU runs](results.md#on-a-gpu) saved in `docs/results/` time one layer's decode step at the 8B "
            "shape on the device (every launch of the step a real cache makes, L2 flushed, median of the repeats; "
            "`device_*`: the same step as one CUDA-graph replay, the device's time without the host's, which "
            "`measured_over_estimate` uses where a run has it). "
            "`estimated_vs_sdpa`: this page's sm_90 layer-step ratio (H100 SXM figures; the ratio to sdpa on the "
            "same device is what carries over to an H200). `measured_over_estimate` below 1: the model is "
            "optimistic by that factor.",
            "",
            _table(compared, list(compared[0])),
            "",
        ]
    if BEFORE.exists() and rows:
        before = json.loads(BEFORE.read_text())
        compared = before_after(rows, before)
        lines += [
            "## Before and after the kernel changes",
            "",
            f"`before → after` where a figure changed; before: {before['what']}. The estimate is the roofline "
            "model's, not a measurement. `int2` then had KIVI's plain layout; its row is now its default (Hadamard "
            "rotation, keys before RoPE, 4 sinks: each key tile rotated back and turned in the launch), which the "
            "kernel did not read before (the reference served it). `int4`'s row is now its default too (Hadamard "
            "rotation folded into the query and the output, 4 sinks, 8-bit scales); `int4 KIVI layout` is its "
            "layout then.",
            "",
            _table(compared, list(compared[0])),
            "",
        ]
    mix = instruction_mix(report)
    if mix:
        lines += [
            "## Main-loop instruction mix (SASS per warp per 64-token tile)",
            "",
            _table(mix, list(mix[0])),
            "",
        ]
    if report.get("helpers"):
        lines += [
            "## Around the decode kernel: the split reduction and the append (8B shape, 16k tokens x batch 8)",
            "",
            "One launch each per layer-step: the splits of every segment reduced together (`triton_combine`), and the "
            "new token stored (`triton_append`: int8 encoded on the way, bit-exact to `quant.quantize_symmetric`).",
            "",
            _table(
                report["helpers"],
                ["kernel", "arch", "grid", "registers", "spill_stores", "shared", "blocks_per_sm", "limited_by"],
            ),
            "",
        ]
    findings = report["findings"] | derived_findings(report["variants"])
    if findings:
        lines += ["## Findings", ""] + [f"- {k}: {v}" for k, v in findings.items()] + [""]
    if report["length_specialization"]:
        lines += [
            "## Length specialization (sm_90)",
            "",
            "Triton marks an integer argument divisible by 16 in the kernel's specialization; the history length "
            "`T` is excluded from it (`do_not_specialize`), so a step whose length is a multiple of 16 and the other "
            "15 in 16 run the same kernel (instructions per warp per 64 tokens; KIVI tiles are aligned to key "
            "groups, so their `T` is always a multiple of 16):",
            "",
            _table(report["length_specialization"], list(report["length_specialization"][0])),
            "",
        ]
    lines += [
        "## Launches per layer and decode step (counted on CPU)",
        "",
        "Rule: " + " ".join(counts_as_launch.__doc__.split()),
        f"Tiny Llama (2 layers, 4/2 heads, head_dim 16), batch 2, one token per step, median over "
        f"{report['count_steps']} steps (max: the step that flushes a residual). `host us`: measured on this CPU (one "
        "thread; the pure-torch reference stands in for each Triton launch), a measurement of this machine, not of a "
        "GPU host.",
        "",
        _table(
            report["launches"],
            ["cache", "attention", "padded", "launches_per_layer", "launches_per_layer_max", "launches_outside_layers"]
            + ["host_syncs_per_step", "host_us_per_layer_step"],
        ),
        "",
        f"## Compiled variants over {report['variant_steps']} decode steps (8B attention shape)",
        "",
        "Distinct kernel specializations (Triton's cache key: one compile each) over four generations of varying "
        "prompt length (203 to 450 tokens) and left padding, one token per step; a batch without padding decodes "
        "without a mask (no mask is built or read), a compile-time switch counted apart (`(no mask)`).",
        "",
        _table(report["compiled_variants"], ["kind", "steps", "variants"] + report["variant_columns"]),
        "",
        "## Estimate: kernel time vs sdpa over bfloat16 (roofline; not a measurement)",
        "",
        "```text",
        MODEL,
        "```",
        "",
        _table(
            report["estimate"], ["kind", "gpu", "shape", "bound", "kernel_us", "sdpa_us", "ratio", "layer_step_ratio"]
        ),
        "",
        "## Every variant",
        "",
        "`launches`: kernel launches of the captured step (one per segment); `waves`: programs / (blocks/SM x SMs) "
        "at 4k x 1, 16k x 8 and 32k x 8; `MB read`: the cache's stored bytes + the mask per layer-step.",
        "",
    ]
    cols = ["kind", "head_dim", "q_len", "padded", "arch", "registers", "spill_stores", "shared", "blocks_per_sm"]
    cols += ["limited_by", "loop_instructions", "launches", "variant"]
    cols += [f"waves {s[0]}" for s in SHAPES] + [f"MB read {s[0]}" for s in SHAPES]
    lines += [_table(report["variants"], cols), ""]
    return "\n".join(lines)


def build(quick: bool, count_steps: int, variant_steps: int, log=print, command: str = "") -> dict:
    """The report. Off CUDA the layers hand the hf_kvcache attention their storage at every length here, as on a
    GPU (``HF_KVCACHE_CPU_HANDLES=always``): the launches intercepted and counted are the ones a GPU's decode step
    makes, not CPU's choice of sdpa's path for short histories."""
    from ...layers import _common

    before, _common.CPU_HANDLES = _common.CPU_HANDLES, "always"
    try:
        return _build(quick, count_steps, variant_steps, log, command)
    finally:
        _common.CPU_HANDLES = before


def _build(quick: bool, count_steps: int, variant_steps: int, log, command: str) -> dict:
    import triton

    tools = aot.toolchain()
    if tools["ptxas"] is None:
        raise RuntimeError(f"triton's CUDA backend is not usable here: {tools['error']}")
    torch.set_num_threads(1)
    log("compiling the variants")
    rows, findings = compile_variants(variant_grid(quick), log)
    log("kernels around decode attention")
    helpers = compile_helpers(log)
    log("length specialization")
    lengths = [] if quick else length_specialization(log)
    log("counting launches")
    launches, table = {}, []
    for spec in ["dynamic", *KINDS.values()]:
        for padded in (False, True):
            launches[(spec, padded)] = c = count_launches(spec, padded, count_steps)
            name = next((k for k, v in KINDS.items() if v == spec), "DynamicCache")
            attention = "sdpa" if spec == "dynamic" else "hf_kvcache"
            table.append({"cache": name, "spec": spec, "attention": attention, "padded": padded} | c)
    log("compiled variants over decode steps")
    variants = [{"kind": k} | count_variants(k, variant_steps) for k in KINDS]
    columns = sorted({c for v in variants for c in v if c.startswith("variants ")})
    return {
        "command": command,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "toolchain": {"ptxas": {a: p for a, p in tools["ptxas"].items()}, "cuobjdump": tools["cuobjdump"]},
        "variants": rows,
        "helpers": helpers,
        "length_specialization": lengths,
        "findings": findings,
        "count_steps": count_steps,
        "launches": table,
        "variant_steps": variant_steps,
        "compiled_variants": variants,
        "variant_columns": columns,
        "estimate": estimate(rows, launches),
        "model": MODEL,
    }


DOCS_INTRO = """\
# GPU report (estimates from CPU)

The project's machines have no GPU, so this page measures the GPU decode path by what is deterministic without one
(issue 22): the Triton decode kernels compiled ahead of time for the A100 (sm_80) and the H100 (sm_90) with Triton's
bundled ptxas, from the exact specialization a real launch gets; kernel launches per layer and decode step counted on
CPU; the kernel variants that decoding compiles. **Every time and speed-up on this page is an estimate** from the
roofline model written out below, not a GPU measurement; registers, spills, shared memory, occupancy, instruction
counts and launch counts are exact for the compiled binaries and the counting rule stated. GPU measurements go to
[Results](results.md#on-a-gpu) ([the GPU run](gpu-run.md)); the section *Measured on a GPU, next to the estimate*
sets the saved runs' kernel times beside this page's estimates: on the first H200 runs the model was optimistic by
3-30x, because it has no term for the host's time per launch, which dominated every step below 64k tokens.

The page is generated (about 20 minutes on a 2-core CPU with a cold Triton compile cache, less with a warm one,
the same numbers either way; `--quick` compiles one variant per storage kind, as the tests do; `--from-json`
re-renders a saved report):

```bash
python benchmarks/gpu_report.py --output results/gpu-report --docs docs/gpu-report.md
python benchmarks/gpu_report.py --output /tmp/gpu-report --quick
```

"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="folder for gpu-report.md and gpu-report.json")
    parser.add_argument("--docs", type=Path, help="also write the docs page (docs/gpu-report.md) from this report")
    parser.add_argument("--quick", action="store_true", help="one variant per kind (head_dim 128, q 1, padded)")
    parser.add_argument("--count-steps", type=int, default=None, help="decode steps counted per cache (default 16)")
    parser.add_argument("--variant-steps", type=int, default=100, help="decode steps for the compiled-variant count")
    parser.add_argument("--from-json", type=Path, help="re-render a saved gpu-report.json instead of measuring")
    parser.add_argument("--gpu-runs", type=Path, help="folder of saved GPU runs (gpu-run-*.json) to set beside the "
                        "estimate (default: the docs page's results/ folder, with --docs)")  # fmt: skip
    args = parser.parse_args(argv)
    count_steps = args.count_steps if args.count_steps is not None else (2 if args.quick else 16)
    if count_steps < 1:
        raise SystemExit(f"--count-steps must be >= 1, got {count_steps}")
    if args.variant_steps < 4:
        raise SystemExit(f"--variant-steps must be >= 4, got {args.variant_steps}")
    if args.from_json:
        report = json.loads(args.from_json.read_text()) | {"model": MODEL}  # the numbers as saved, the text as now
    else:
        command = " ".join(["python benchmarks/gpu_report.py", *(sys.argv[1:] if argv is None else argv)])
        report = build(args.quick, count_steps, args.variant_steps, lambda m: print(m, file=sys.stderr), command)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    folder = args.gpu_runs or (args.docs.parent / "results" if args.docs else None)
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("gpu-run-*.json"))} if folder else {}
    text = render(report, runs)
    (args.output / "gpu-report.md").write_text(text)
    if args.docs:
        body = text.split("\n", 1)[1].lstrip()  # the page has its own title
        args.docs.write_text(DOCS_INTRO + body)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
