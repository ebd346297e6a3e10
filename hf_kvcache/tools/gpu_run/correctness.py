"""Stage ``correctness``: the compiled kernels against their pure-torch references on the device, in float16 and
bfloat16 (the CPU interpreter cannot check bfloat16), for every storage kind, and one model end to end.

1. **decode**: per cache kind, a one-layer cache at Llama-3-8B's attention shape holding 1,000 tokens (2 rows, row 1
   left-padded by 7), one decode step of 1 and of 4 new tokens (causal) read by ``decode_attention`` (the Triton
   launches on CUDA) and by the pure-torch reference (``torch_decode.partial`` per segment, ``torch_decode.combine``),
   compared with the tolerance of ``tests/test_kernels.py`` (2e-3 in float16, 1.6e-2 in bfloat16, relative to the
   output's scale);
2. **encode**: the tokens a cache encodes, by the Triton launch (``encode_into``: int8's append, KIVI's encode) and
   by the codec's torch ``encode`` on the same device and on the CPU: the share of identical codes, scales and zero
   points (the kernels are meant to be bit-exact to the CPU reference; torch on CUDA divides by a Python scalar as a
   multiplication by its reciprocal, so its own scales can differ in the last bit), and the kernel's worst
   reconstruction error over the reference's;
3. **model**: a small random Llama (head_dim 128) in each dtype, a prompt then 8 teacher-forced decode steps through
   each cache under sdpa and under ``hf_kvcache``: the largest logit difference of the two attention paths over the
   same cache, relative to the logits' spread;
4. **saved**: each of those caches, and the window cache's two kinds, prefilled, saved (``torch.save``: its stored
   tokens copied to the host) and loaded (``load_cache``: back on the device), then the same decode steps under sdpa
   through the loaded and the saved cache: the logits must be identical, and the file about the cache's ``nbytes``.

Each check is one item with ``passed``; a check that raises (a kernel that does not compile here) is an error item
and the next runs.
"""

from __future__ import annotations

import io

import torch
from transformers import LlamaForCausalLM

from ..._compat import with_cache
from ...caches import load_cache
from ...caches._base import _tensor_devices
from ...formats import KVHandle, codec_for, decode_attention
from ...kernels import torch_decode
from ...registry import make_cache
from .kernels import decode_handle, triton_status
from .record import StageRecord
from .shapes import SMOKE_MODEL, cache_kinds, model_config

__all__ = ["TOLERANCE", "headline", "run"]

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
PAD = 7  # left padding of row 1


def _mask(batch: int, q_len: int, total: int, device) -> torch.Tensor:
    """``(B, 1, q, T)``: row 1 left-padded, query token i not seeing the last ``q - 1 - i`` tokens."""
    mask = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device=device)
    mask[1:, :, :, :PAD] = False
    for i in range(q_len - 1):
        mask[:, :, i, total - (q_len - 1 - i) :] = False
    return mask


def _torch_attention(query, handle: KVHandle, mask, scaling) -> torch.Tensor:
    parts, col = [], 0
    for segment in handle.segments:
        part_mask = mask[:, 0, :, col : col + segment.length]
        parts.append(torch_decode.partial(query, segment, part_mask, scaling, 0.0, 1))
        col += segment.length
    return torch_decode.combine(parts, None, torch.float32)


def _decode_checks(record: StageRecord, dev, dtype, q_len: int, smoke: bool) -> None:
    config = model_config(smoke, layers=1)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    context = 300 if smoke else 1000
    scaling = dim**-0.5
    g = torch.Generator(device=dev).manual_seed(1 + q_len)
    k = torch.randn((2, kv_heads, context, dim), generator=g, device=dev, dtype=dtype)
    v = torch.randn((2, kv_heads, context, dim), generator=g, device=dev, dtype=dtype)
    new = [torch.randn((2, kv_heads, q_len, dim), generator=g, device=dev, dtype=dtype) for _ in range(2)]
    query = torch.randn((2, heads, q_len, dim), generator=g, device=dev, dtype=dtype)
    for label, spec in cache_kinds().items():
        what = f"decode {label} {str(dtype)[6:]} q={q_len}"
        if record.out_of_time(what, 2):
            continue
        try:
            handle = decode_handle(spec, config, k, v, *new)[0]
            mask = _mask(2, q_len, handle.length, dev)
            got = decode_attention(query, handle, mask, scaling).float()
            want = _torch_attention(query, handle, mask, scaling)
        except Exception as err:
            record.error(what, err)
            continue
        scale = max(1.0, float(want.abs().max()))
        err = float((got - want).abs().max()) / scale
        tol = TOLERANCE[dtype]
        record.add({"check": "decode", "kind": label, "dtype": str(dtype), "q_len": q_len,
                    "segments": [type(s).__name__ for s in handle.segments], "max_error": err,
                    "tolerance": tol, "passed": err <= tol})  # fmt: skip


def _encode_checks(record: StageRecord, dev, dtype) -> None:
    codecs = {f"int{b}": codec_for(b, 64 if b < 8 else None) for b in (8, 4, 3, 2)}
    codecs["int3 lloyd"] = codec_for(3, 64, codebook="lloyd")  # nearest levels by counting midpoints, two bit planes
    g = torch.Generator(device=dev).manual_seed(2)
    # 12 decades of magnitude across rows and channels: scales at every exponent, codes at rounding ties
    k = torch.randn((2, 4, 256, 128), generator=g, device=dev) * torch.logspace(-6, 6, 128, device=dev)
    v = torch.randn((2, 4, 256, 128), generator=g, device=dev) * torch.logspace(-6, 6, 256, device=dev)[:, None]
    k, v = k.to(dtype), v.to(dtype)
    for name, codec in codecs.items():
        what = f"encode {name} {str(dtype)[6:]}"
        if record.out_of_time(what, 2):
            continue
        try:
            want = codec.encode(k, v)
            got = {n: torch.empty_like(t) for n, t in want.items()}
            codec.encode_into(k, v, got)
            on_cpu = codec.encode(k.cpu(), v.cpu())
            ratio = _error_ratio(codec, got, want, k, v)
        except Exception as err:
            record.error(what, err)
            continue
        same = _identical(got, want)
        same_cpu = _identical(got, on_cpu)
        exact = all(s == 1.0 for s in same.values()) or all(s == 1.0 for s in same_cpu.values())
        record.add({"check": "encode", "kind": name, "dtype": str(dtype), "identical_bytes": same,
                    "identical_bytes_cpu_reference": same_cpu, "error_over_reference": ratio,
                    "passed": exact})  # fmt: skip


def _identical(got: dict, want: dict) -> dict[str, float]:
    """Per stored part, the share of bytes ``got`` has as ``want`` (compared on ``want``'s device)."""
    return {n: float((got[n].to(t.device).view(torch.uint8) == t.view(torch.uint8)).float().mean())
            for n, t in want.items()}  # fmt: skip


def _error_ratio(codec, got: dict, want: dict, k: torch.Tensor, v: torch.Tensor) -> float:
    """The kernel's worst reconstruction error over the reference's, on the finite inputs: about 1 for a valid
    encoding that differs only in rounding, far above 1 for a wrong one (what a byte count alone cannot tell)."""
    worst = []
    for parts in (got, want):
        k_out, v_out = torch.empty_like(k), torch.empty_like(v)
        codec.decode(parts, k_out, v_out)
        errors = [
            ((o.float() - x.float()).abs() * x.isfinite()).nan_to_num().amax() for o, x in ((k_out, k), (v_out, v))
        ]
        worst.append(float(max(errors)))
    return worst[0] / worst[1] if worst[1] > 0 else (1.0 if worst[0] == 0 else float("inf"))


def _prefilled(model, spec: str, attn: str, ids: torch.Tensor, prompt: int):
    model.set_attn_implementation(attn)
    cache = make_cache(spec, model)
    with torch.inference_mode():
        model(input_ids=ids[:, :prompt], attention_mask=torch.ones_like(ids[:, :prompt]), **with_cache(model, cache))
    return cache


def _continued(model, cache, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of each decode step after the ``prompt`` tokens ``cache`` holds, feeding ``ids`` one token at a time."""
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        steps = [
            model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **with_cache(model, cache)).logits
            for t in range(prompt, ids.shape[1])
        ]
    return torch.cat(steps, 1).float()


def _teacher_forced(model, spec: str, attn: str, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of each decode step after a ``prompt``-token prefill, feeding ``ids`` one token at a time."""
    return _continued(model, _prefilled(model, spec, attn, ids, prompt), ids, prompt)


def _saved_check(model, spec: str, ids: torch.Tensor, prompt: int) -> dict:
    """A cache prefilled on the device, saved (its stored tokens copied to the host) and loaded (back on the device):
    the next steps through the loaded cache against the saved one's, under sdpa (exact: the same stored tokens).
    Loaded again with ``map_location="cpu"``: every tensor and layer device record on the host (``on_cpu``)."""
    cache = _prefilled(model, spec, "sdpa", ids, prompt)
    f = io.BytesIO()
    torch.save(cache, f)
    f.seek(0)
    nbytes = cache.nbytes
    loaded = load_cache(f, model)
    got, want = _continued(model, loaded, ids, prompt), _continued(model, cache, ids, prompt)
    err = float((got - want).abs().max())
    small = len(f.getvalue()) <= 1.1 * nbytes + 64 * 1024  # the live tokens (and pickle's own bytes), not storage
    f.seek(0)
    moved = load_cache(f, model, map_location="cpu")
    records = {str(getattr(layer, "device", "cpu")) for layer in moved.layers}
    on_cpu = {str(d) for d in _tensor_devices(moved)} | records <= {"cpu"}
    return {"max_error": err, "tolerance": 0.0, "file_bytes": len(f.getvalue()), "nbytes": nbytes, "on_cpu": on_cpu,
            "passed": err == 0 and small and on_cpu}  # fmt: skip


def _model_checks(record: StageRecord, dev, dtype, smoke: bool) -> None:
    config = model_config(smoke=True)  # tiny layers, but the 8B head shape where it matters: head_dim 128
    config.head_dim, config.num_attention_heads, config.num_key_value_heads = 128, 8, 2
    # The kernels see the heads only; the smoke run's narrower residual stream (its projections 4x cheaper on the CPU)
    # changes none of their shapes.
    config.hidden_size = SMOKE_MODEL["hidden_size"] if smoke else 8 * 128
    prompt = 200 if smoke else 700
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(3, config.vocab_size, (2, prompt + 8), generator=torch.Generator().manual_seed(3))
    ids = ids.to(dev)
    for label, spec in {"dynamic": "dynamic", **cache_kinds(), **SAVED_ONLY}.items():
        if label not in SAVED_ONLY:
            _add_model(record, model, label, spec, ids, prompt, dtype)
        if spec != "dynamic":
            _add_saved(record, model, label, spec, ids, prompt, dtype)
    del model


def _add_model(record: StageRecord, model, label: str, spec: str, ids: torch.Tensor, prompt: int, dtype) -> None:
    what = f"model {label} {str(dtype)[6:]}"
    if record.out_of_time(what, 3):
        return
    try:
        sdpa = _teacher_forced(model, spec, "sdpa", ids, prompt)
        ours = _teacher_forced(model, spec, "hf_kvcache", ids, prompt)
    except Exception as err:
        record.error(what, err)
        return
    err = float((ours - sdpa).abs().max() / sdpa.std())
    tol = 4 * TOLERANCE[dtype] if dtype != torch.float32 else 1e-3
    record.add({"check": "model", "kind": label, "dtype": str(dtype), "max_error_over_std": err,
                "tolerance": tol, "passed": err <= tol})  # fmt: skip


# Saved and loaded beside the kinds the run times: the window cache (its sinks and window, and the full-precision
# storage of its layers) is in no timed stage.
SAVED_ONLY = {"sink": "sink:window=128:sinks=4", "sink int8": "sink:window=128:sinks=4:bits=8"}


def _add_saved(record: StageRecord, model, label: str, spec: str, ids: torch.Tensor, prompt: int, dtype) -> None:
    what = f"saved {label} {str(dtype)[6:]}"
    if record.out_of_time(what, 2):
        return
    try:
        record.add({"check": "saved", "kind": label, "dtype": str(dtype)} | _saved_check(model, spec, ids, prompt))
    except Exception as err:
        record.error(what, err)


def run(record: StageRecord, device: str, smoke: bool) -> None:
    dev = torch.device(device)
    ok, why = triton_status()
    # The interpreter computes bfloat16 wrongly: on CPU the checks run in float32 and float16.
    dtypes = [torch.float16, torch.bfloat16] if dev.type == "cuda" else [torch.float32, torch.float16]
    record.info |= {"triton": ok, "triton_error": why, "dtypes": [str(d) for d in dtypes]}
    record.save()
    # The order buys the most coverage per second of a box that rarely holds every check (each kernel variant
    # compiles once, 2-8 s on a fresh machine): the dtype the CPU interpreter cannot check first, and in it the one
    # decode token of every kind, the encodes, the model, then several query tokens; the other dtype last.
    for dtype in (dtypes[1], dtypes[0]):
        _decode_checks(record, dev, dtype, 1, smoke)
        _encode_checks(record, dev, dtype)
        _model_checks(record, dev, dtype, smoke)
        _decode_checks(record, dev, dtype, 4, smoke)


def headline(record: dict) -> list[str]:
    items = record.get("items", [])
    lines = []
    for check in ("decode", "encode", "model", "saved"):
        mine = [i for i in items if i["check"] == check]
        if check == "saved" and not mine:  # runs before 2026-12-03 had no such check
            continue
        failed = [f"{i['kind']} {i['dtype'][6:]}" + (f" q={i['q_len']}" if "q_len" in i else "") for i in mine
                  if not i["passed"]]  # fmt: skip
        verdict = f"; FAILED {failed}" if failed else ""
        lines.append(f"{check}: {len(mine) - len(failed)}/{len(mine)} passed{verdict}")
    if record.get("skipped"):
        lines.append(f"skipped (time): {len(record['skipped'])}")
    return lines
