"""KIVI codes decoded and encoded on the CPU by a small C kernel (``kivi_cpu.c``), built at first use with the
machine's compiler; int8 token buffers' codes encoded by it too, and Hadamard-rotated int8 codes (an int8
residual's at the int3 / int2 defaults' rotation) decoded and rotated back in one pass.

Under sdpa (and wherever a quantized layer hands attention dequantized K/V) every forward decodes the whole history
of every layer. In pure torch that is ~15 passes over it for the int3 / int2 defaults (unpack two bit planes,
dequantize, rotate back, turn pre-RoPE keys), where DynamicCache reads its tensors as they are. The kernel does the
same work in one pass per token, the token held in vector registers (SmolLM2's int3 decode step on one CPU thread:
0.37x DynamicCache's speed at 4k tokens in torch, 1.08x with the kernel: benchmarks/bench_cpu.py, docs/results.md);
its outputs equal the torch path's to float32 rounding (tests/test_cpu_native.py). Encoding (a group's range, scale,
codes, packing: ~20 torch operations per tensor, each a pass or a small allocation) is one pass too, bit for bit
equal to :func:`hf_kvcache.quant.quantize_asymmetric` and :func:`~hf_kvcache.quant.pack`, and int8's to
:func:`~hf_kvcache.quant.quantize_symmetric`.

Nothing is compiled where it cannot serve: float32 outputs and scales, uniform codes of 2, 3 or 4 bits, widths that
are multiples of 8 (powers of two where rotated), RoPE in the ``rotate_half`` layout over the whole head. Anything
else, a machine without a C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``), or ``HF_KVCACHE_NATIVE_CPU=never``
takes the torch path; :func:`status` says which and why. The library is cached per source, compiler and CPU under
``$HF_KVCACHE_CACHE`` (default ``~/.cache/hf_kvcache``), so a process pays the compile (~1 s) only the first time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = [
    "BITS",
    "NATIVE_CPU_CHOICES",
    "decode_int8_rotated",
    "decode_kivi",
    "encode_int8",
    "encode_kivi",
    "serves",
    "status",
    "usable",
    "width_served",
]

SOURCE = Path(__file__).with_name("kivi_cpu.c")
NATIVE_CPU_CHOICES = ("auto", "never")
# Read at every decode (tests and benchmarks switch it), from HF_KVCACHE_NATIVE_CPU at import.
NATIVE_CPU = os.environ.get("HF_KVCACHE_NATIVE_CPU", "auto")
MAX_WIDTH = 1024  # the kernel's per-token scratch
BITS = (2, 3, 4)
# Below this many decoded floats one thread does the work: a thread pool's hand-off costs more than it saves.
PARALLEL_FLOATS = 1 << 18

_LOCK = threading.Lock()
_WHY_NOT: list[str] = []  # why the library could not be built or loaded in this process (empty: it was, or not tried)


def status() -> str:
    """``"built: <library>"``, ``"disabled: ..."`` or ``"unavailable: <why>"`` (building it if not tried yet)."""
    if not _switched_on():
        return f"disabled: HF_KVCACHE_NATIVE_CPU={NATIVE_CPU}"
    lib = _library()
    return f"built: {lib._name}" if lib is not None else f"unavailable: {_WHY_NOT[-1]}"


def _cache_dir() -> Path:
    from ..models import model_cache_dir  # at first use: the kernels package imports nothing of the rest at import

    return model_cache_dir() / "native"


def _cpu_key() -> str:
    """What a library built with ``-march=native`` depends on: the CPU's model and instruction-set flags (a cache
    folder shared between machines must not hand one machine another's instructions)."""
    text = platform.machine() + platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text += "".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return text


def _compiler() -> list[str] | None:
    """The compiler's command: ``$CC`` as the shell would split it (``ccache gcc``), else the first found."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    return [found] if found else None


def _build() -> Path:
    """The library's path, compiled into the cache folder first if absent (written under a temporary name and moved
    into place, so processes building at once never load half a file)."""
    if os.name != "posix":
        raise OSError(f"building the kernel is supported on POSIX systems only, not {os.name!r}")
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found ($CC, cc, gcc or clang)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(cc).encode() + _cpu_key().encode()).hexdigest()[:16]
    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder)
        probe.close()
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"hf_kvcache-native-{os.getuid()}"
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kivi_cpu-{key}.so"
    if path.is_file():
        return path
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    errors = []
    try:
        # -march=native where the compiler takes it (the library is built for, and cached per, this CPU)
        for flags in (["-O3", "-march=native"], ["-O3"]):
            cmd = [*cc, *flags, "-std=gnu11", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
            errors.append(done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"])
        raise OSError(f"{' '.join(cc)} failed: {errors[-1][0][:300]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    with _LOCK:
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, subprocess.SubprocessError) as err:
            _WHY_NOT.append(f"{type(err).__name__}: {err}")
            return None
    lib.kivi_cpu_init()
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kivi_decode_f32.argtypes = [p, p, p, p, p, i64, i64, i64, i32, i64, i32, ctypes.c_float, i32, p, i64, i64, i64]
    lib.kivi_decode_f32.restype = None
    lib.kivi_encode_f32.argtypes = [p, p, p, p, p, i64, i64, i64, i32, i64, i32, i64, i64]
    lib.kivi_encode_f32.restype = i32
    lib.int8_encode_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.int8_encode_f32.restype = i32
    lib.int8_decode_rotated_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, ctypes.c_float, i64, i64]
    lib.int8_decode_rotated_f32.restype = None
    return lib


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="hf_kvcache-native")


def _switched_on() -> bool:
    """Not ``HF_KVCACHE_NATIVE_CPU=never``, nor inside a graph being traced (which cannot call into a C library: the
    torch path, fused)."""
    if NATIVE_CPU not in NATIVE_CPU_CHOICES:
        raise ValueError(f"HF_KVCACHE_NATIVE_CPU must be one of {', '.join(NATIVE_CPU_CHOICES)}, got {NATIVE_CPU!r}")
    return NATIVE_CPU != "never" and not torch.compiler.is_compiling()


def usable() -> bool:
    """Whether the kernel is switched on and built (building it if not tried yet)."""
    return _switched_on() and _library() is not None


def width_served(width: int, rotate: bool) -> bool:
    """Whether the kernel reads heads ``width`` channels wide (rotated: a power of two)."""
    return width % 8 == 0 and 0 < width <= MAX_WIDTH and not (rotate and width & (width - 1))


def serves(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor, bits: int,
           rotate: bool, angles: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether :func:`decode_kivi` takes these tensors (before the library is built: a layout it cannot read never
    costs a compile)."""
    if not _switched_on() or out.device.type != "cpu" or bits not in BITS or out.dim() != 4 or not out.numel():
        return False
    if codes.dtype != torch.uint8 or any(x.dtype != torch.float32 for x in (scale, zero, out)):
        return False
    if not width_served(out.shape[-1], rotate):
        return False
    if angles is not None and (angles.dtype != torch.float32 or not angles.is_contiguous()):
        return False
    return all(t.dim() == 4 and t.stride(-1) == 1 and t.device.type == "cpu" for t in (codes, scale, zero, out))


def _shapes_agree(codes, scale, zero, out, bits, group, per_token, rope) -> bool:
    """Whether every tensor covers what the kernel reads for ``out``'s tokens (it checks no bounds itself)."""
    b, h, t, width = out.shape
    rows = t if per_token else -(-t // group)
    params = (b, h, rows, width // group) if per_token else (b, h, rows, width)
    if (per_token and width % group) or tuple(codes.shape) != (b, h, t, width * bits // 8):
        return False
    if any(tuple(x.shape[:2]) != params[:2] or x.shape[2] < rows or x.shape[3] != params[3] for x in (scale, zero)):
        return False
    return rope is None or (rope[0].shape[0] >= rope[1] + t and tuple(rope[0].shape[1:]) == (2, width // 2))


def _strides(*tensors: torch.Tensor) -> ctypes.Array:
    """The first three strides of each tensor, in order, as the kernel's int64 array (elements)."""
    return (ctypes.c_int64 * (3 * len(tensors)))(*(n for x in tensors for n in x.stride()[:3]))


def _over_rows(call, rows: int, floats: int) -> list:
    """``call(r0, r1)`` over ``[0, rows)``: in one piece, or split over torch's intra-op thread count where there is
    enough work (ctypes lets go of the GIL for the call, so each thread runs its own rows)."""
    threads = min(torch.get_num_threads(), rows)
    if threads <= 1 or floats < PARALLEL_FLOATS:
        return [call(0, rows)]
    step = -(-rows // threads)
    return list(_pool(threads).map(lambda r0: call(r0, min(r0 + step, rows)), range(0, rows, step)))


def decode_kivi(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor, bits: int,
                group: int, per_token: bool, rotate: bool = False, rope: tuple[torch.Tensor, int] | None = None,
                ) -> bool:  # fmt: skip
    """Decode one stored KIVI tensor into ``out`` ``(B, H, T, D)`` (any strides but a contiguous last dimension),
    rotated back by the Hadamard transform of the head (``rotate``) and turned to positions ``first ..`` where
    ``rope`` is ``(angle table, first)`` (:func:`hf_kvcache.rope.angle_table`, every channel rotary, ``rotate_half``
    pairs). ``codes`` ``(B, H, T, D * bits / 8)``; ``scale`` / ``zero`` ``(B, H, T, D / group)`` per token
    (``per_token``), else ``(B, H, T / group, D)`` per key group. Returns False, touching nothing, where the kernel
    cannot serve (see the module's docstring): the caller decodes in torch then."""
    angles, first = rope if rope is not None else (None, 0)
    if not serves(codes, scale, zero, out, bits, rotate, angles) or not _shapes_agree(
        codes, scale, zero, out, bits, group, per_token, rope
    ):
        return False
    lib = _library()
    if lib is None:
        return False
    b, h, t, width = out.shape
    strides = _strides(codes, scale, zero, out)
    gain = 1 / math.sqrt(width) if rotate else 1.0
    args = (codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), strides, h, t, width, bits, group,
            int(per_token), gain, int(rotate), angles.data_ptr() if angles is not None else None, first)  # fmt: skip
    _over_rows(lambda r0, r1: lib.kivi_decode_f32(*args, r0, r1), b * h * t, out.numel())
    return True


def decode_int8_rotated(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, group: int) -> bool:
    """Decode Hadamard-rotated int8 ``codes`` ``(B, H, T, D)`` with float32 ``scale`` ``(B, H, T, D / group)`` into
    float32 ``out`` of the codes' shape, rotated back: what :class:`~hf_kvcache.formats.RotatedCodec` over
    :class:`~hf_kvcache.formats.Int8Codec` decodes, to float32 rounding (``D`` a power of two). Any strides with a
    contiguous last dimension. Returns False, touching nothing, where the kernel cannot serve: the caller decodes in
    torch then."""
    if not _switched_on() or out.dim() != 4 or not out.numel() or group < 1:
        return False
    if codes.dtype != torch.int8 or scale.dtype != torch.float32 or out.dtype != torch.float32:
        return False
    b, h, t, width = out.shape
    if not width_served(width, rotate=True) or width % group:
        return False
    if tuple(codes.shape) != tuple(out.shape) or tuple(scale.shape) != (b, h, t, width // group):
        return False
    tensors = (codes, scale, out)
    if any(x.device.type != "cpu" or x.stride(-1) != 1 for x in tensors):
        return False
    lib = _library()
    if lib is None:
        return False
    args = (*(x.data_ptr() for x in tensors), _strides(*tensors), h, t, width, group, 1 / math.sqrt(width))
    _over_rows(lambda r0, r1: lib.int8_decode_rotated_f32(*args, r0, r1), b * h * t, out.numel())
    return True


def encode_kivi(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                group: int, per_token: bool) -> bool:  # fmt: skip
    """KIVI-encode float32 ``x`` ``(B, H, T, D)`` into ``codes`` ``(B, H, T, D * bits / 8)`` and float32 ``scale`` /
    ``zero``, ``(B, H, T, D / group)`` per token (``per_token``: groups of ``group`` channels), else
    ``(B, H, T / group, D)`` per channel over key groups of ``group`` tokens: what
    :func:`~hf_kvcache.quant.quantize_asymmetric` (uniform levels, float32 scales) and :func:`~hf_kvcache.quant.pack`
    give, bit for bit. Any strides with a contiguous last dimension (views of a layer's storage). Returns False where
    it did not encode (layouts it cannot read, a value that is not finite: what it wrote is then undefined, and the
    caller encodes in torch, which masks such values)."""
    if not _switched_on() or bits not in BITS or x.dim() != 4 or not x.numel():
        return False
    if codes.dtype != torch.uint8 or any(y.dtype != torch.float32 for y in (x, scale, zero)):
        return False
    b, h, t, width = x.shape
    if not width_served(width, rotate=False) or (width if per_token else t) % group:
        return False
    params = (b, h, t, width // group) if per_token else (b, h, t // group, width)
    if tuple(codes.shape) != (b, h, t, width * bits // 8) or any(tuple(p.shape) != params for p in (scale, zero)):
        return False
    tensors = (x, codes, scale, zero)
    return _encode("kivi_encode_f32", tensors, b * h * params[2], h, t, width, bits, group, int(per_token))


def encode_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    """Symmetric int8 codes of float32 ``x`` ``(B, H, T, D)`` into int8 ``codes`` of its shape and float32 ``scale``
    ``(B, H, T, D / group)``: what :func:`~hf_kvcache.quant.quantize_symmetric` gives, bit for bit. Any strides with
    a contiguous last dimension. False where it did not encode (another layout, a value that is not finite): the
    caller encodes in torch then."""
    if not _switched_on() or x.dim() != 4 or not x.numel() or x.shape[-1] % group:
        return False
    if x.dtype != torch.float32 or codes.dtype != torch.int8 or scale.dtype != torch.float32:
        return False
    b, h, t, width = x.shape
    if tuple(codes.shape) != tuple(x.shape) or tuple(scale.shape) != (b, h, t, width // group):
        return False
    return _encode("int8_encode_f32", (x, codes, scale), b * h * t, h, t, width, group)


def _encode(name: str, tensors: tuple[torch.Tensor, ...], rows: int, *sizes: int) -> bool:
    """The library's encoder ``name`` over ``rows`` rows of ``tensors`` (the input first, then its outputs, shapes
    checked by the caller): False where a tensor is not on the CPU with a contiguous last dimension (checked here
    for all of them), the library is not built, or a value is not finite."""
    if any(y.device.type != "cpu" or y.stride(-1) != 1 for y in tensors):
        return False
    lib = _library()
    if lib is None:
        return False
    encoder = getattr(lib, name)
    args = (*(y.data_ptr() for y in tensors), _strides(*tensors), *sizes)
    return not any(_over_rows(lambda r0, r1: encoder(*args, r0, r1), rows, tensors[0].numel()))
