"""Ahead-of-time compilation of the Triton decode kernels for a GPU this machine does not have.

What :mod:`gpu_report` needs from Triton, without a GPU:

* :func:`capturing` runs real code (a cache's decode step on CPU) while every launch of the decode kernel is
  intercepted instead of run: :class:`Launch` keeps the arguments the launch was given and the specialization Triton's
  binder computes from them (the same generated binder ``JITFunction.run`` calls: integer arguments equal to 1 become
  constants, integers and pointers divisible by 16 get ``tt.divisibility``), for a given target.
* :func:`compile_launch` compiles that exact specialization with ``triton.compile(ASTSource(...), target=GPUTarget(
  "cuda", arch, 32))`` and Triton's bundled ptxas, and reads the cubin back: registers and stack (``cuobjdump
  -res-usage``), spills (``ptxas -v`` on the same PTX with Triton's flags), shared memory (Triton's metadata, what the
  launch requests), and the SASS instructions of the main loop (the longest backward branch in ``cuobjdump -sass``;
  PTX instructions, said so, when cuobjdump is absent).
* :func:`occupancy` turns registers, shared memory and warps into resident blocks per SM from the SM limits.

CPU tensors and CUDA tensors specialize alike here: both allocators align storage to at least 64 bytes, so a
pointer's divisibility by 16 depends on the view's offset only, which the real code computes the same way.

It runs in a process started without ``TRITON_INTERPRET=1``: with it, Triton's own library functions are interpreted
functions that code generation cannot compile (the test suite, which turns the interpreter on, runs the report's
command in a subprocess).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from hf_kvcache.kernels.waves import SM_LIMITS, SMLimits, occupancy  # noqa: F401 (the report reads them here)

# (arch, SMs of the reference GPU, its name): the two targets of the report.
TARGETS = {80: "A100 (sm_80)", 90: "H100 (sm_90)"}


# --- the kernel module, compiled (not interpreted) ---------------------------------------------------------------


def check_compiled_mode() -> None:
    """Refuse to run where ``TRITON_INTERPRET`` was on when triton was imported: Triton's own library functions
    (``tl.sigmoid``, ``tl.zeros``...) are then interpreted functions that code generation cannot inline."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if not isinstance(tl.standard.zeros, JITFunction) or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            "AOT compilation needs a process started without TRITON_INTERPRET=1 (it was set when triton was imported)"
        )


@functools.cache
def kernel_module():
    """:mod:`hf_kvcache.kernels.triton_decode`, its kernels compiled (``JITFunction``), not interpreted."""
    check_compiled_mode()
    from hf_kvcache.kernels import triton_decode

    return triton_decode


@functools.cache
def kernels() -> dict:
    """Every Triton kernel of the package by name: the decode kernel, the split reduction, the appends."""
    check_compiled_mode()
    from hf_kvcache.kernels import triton_append

    decode = kernel_module()
    return {
        "partial": decode._partial_kernel,
        "partial_group": decode._partial_group_kernel,
        "combine": decode._combine_kernel,
        "append": triton_append._append_kernel,
        "kivi_encode": triton_append._kivi_encode_kernel,
    }


@functools.cache
def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", arch, 32))


@functools.cache
def _binder(arch: int, name: str = "partial"):
    """The binder ``JITFunction.create_binder`` builds, for ``arch`` instead of the active device."""
    from triton.runtime.jit import create_function_from_signature

    kernel = kernels()[name]
    return create_function_from_signature(kernel.signature, kernel.params, _backend(arch))


@dataclasses.dataclass
class Launch:
    """One intercepted launch of one of our kernels: its grid, its bound arguments and what they specialize to."""

    grid: tuple[int, ...]
    kwargs: dict
    bound: dict  # parameter name -> argument
    specialization: list  # per parameter: (type, attribute) as the binder returns it
    segment: str  # the storage segment's class name (decode launches)
    kernel: str = "partial"  # a name of kernels()

    @property
    def key(self) -> str:
        """Triton's kernel-cache key for this launch (options are the defaults for every launch here)."""
        return f"{self.kernel} {self.specialization}"

    def constexprs(self) -> dict:
        return {name: v for name, (kind, v) in zip(self.bound, self.specialization) if kind == "constexpr"}


def _specialize(args: tuple, kwargs: dict, arch: int, name: str = "partial") -> tuple[dict, list]:
    bound, specialization, _ = _binder(arch, name)(*args, **kwargs)
    return bound, specialization


_CAPTURE: list | None = None


def _interceptor(name: str):
    def intercept(*args, grid, warmup, **kwargs):
        bound, specialization = _specialize(args, kwargs, 90, name)
        grid = tuple(grid(bound) if callable(grid) else grid)
        _CAPTURE.append(Launch(grid, kwargs, bound, specialization, "", name))

    return intercept


@contextlib.contextmanager
def capturing():
    """Within the block, every launch of our kernels (:func:`kernels`) is recorded instead of run; yields the list
    they are appended to."""
    global _CAPTURE
    previous, _CAPTURE = _CAPTURE, []
    for name, kernel in kernels().items():
        kernel.run = _interceptor(name)
    try:
        yield _CAPTURE
    finally:
        for kernel in kernels().values():
            del kernel.run
        _CAPTURE = previous


def launch_partial(query, segment, mask, scaling, softcap, splits) -> Launch | None:
    """What ``triton_partial`` launches for one segment (inside :func:`capturing`); None when it launched nothing (a
    segment the kernel does not read: the reference serves it)."""
    if _CAPTURE is None:
        raise RuntimeError("launch_partial runs inside capturing()")
    before = len(_CAPTURE)
    query, segment = segment.launch_input(query)  # smoothed keys: the query divided first, the inner segment read
    storage = segment.kernel_storage()
    plan = None if storage is None else segment.launch_plan(query, mask)
    if plan is not None:  # as hf_kvcache.formats.launch does on CUDA
        kernel_module().triton_partial(query, storage, plan, mask, scaling, softcap, splits)
    if len(_CAPTURE) == before:
        return None
    launch = _CAPTURE[-1]
    while hasattr(segment, "inner"):  # a rotated or pre-RoPE segment: named by the storage it reads
        segment = segment.inner
    launch.segment = type(segment).__name__
    return launch


# --- compiling and reading the binary --------------------------------------------------------------------------


def _tool(name: str) -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else shutil.which(name)


def toolchain() -> dict:
    """Which of Triton's bundled CUDA tools are present (the report needs ptxas; cuobjdump gives SASS)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = {arch: get_ptxas(arch).path for arch in TARGETS}
    except Exception as err:  # no CUDA backend in this triton
        return {"ptxas": None, "cuobjdump": None, "error": f"{type(err).__name__}: {err}"}
    return {"ptxas": ptxas, "cuobjdump": _tool("cuobjdump"), "error": None}


def _ptxas_log(ptx: str, arch: int, fp_fusion: bool) -> str:
    """``ptxas -v`` on the PTX Triton produced, with the flags Triton's ``make_cubin`` passes."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        cmd = [get_ptxas(arch).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(tmp, "k.cubin"))]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stderr


def _res_usage(cubin: bytes, tool: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        text = subprocess.run([tool, "-res-usage", str(path)], check=True, capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", str(path)], check=True, capture_output=True, text=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"usage": {k: int(v) for k, v in usage.items()}, "sass": sass}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_main_loop(sass: str) -> dict:
    """Instructions of the main loop: the span of the longest backward branch (``BRA`` to a lower address), each
    instruction issued once per warp per iteration (one ``BLOCK_N`` tile of tokens)."""
    instructions = [(int(a, 16), text.strip()) for a, text in _SASS_LINE.findall(sass)]
    loops = []
    for addr, text in instructions:
        m = re.search(r"\bBRA(?:\.\S+)*\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        return {"loop_instructions": None, "loops": 0, "loop_ops": {}}
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = [t for a, t in instructions if start <= a <= end]
    ops: dict[str, int] = {}
    for t in body:
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
    return {"loop_instructions": len(body), "loops": len(loops), "loop_ops": dict(sorted(ops.items()))}


def ptx_main_loop(ptx: str) -> dict:
    """PTX instructions of the longest backward branch (when no cuobjdump is available)."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\$L__\w+:", line)}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            span = (labels[m.group(1)], i)
            best = span if best is None or span[1] - span[0] > best[1] - best[0] else best
    if best is None:
        return {"loop_instructions": None, "loops": 0, "loop_ops": {}}
    body = [x for x in lines[best[0] : best[1] + 1] if x and not x.startswith(("$", "//", "{", "}", "."))]
    return {"loop_instructions": len(body), "loops": 1, "loop_ops": {}}


@dataclasses.dataclass
class Compiled:
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    warps: int
    stages: int
    loop_instructions: int | None
    loop_unit: str  # "SASS" or "PTX"
    loop_ops: dict  # SASS opcode -> instructions of the main loop
    blocks_per_sm: int
    limited_by: str
    fits: bool

    def row(self) -> dict:
        return dataclasses.asdict(self)


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile ``launch``'s specialization for ``sm_<arch>`` and read its resources and main loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernels()[launch.kernel]
    backend = _backend(arch)
    bound, specialization = _specialize(tuple(launch.bound.values()), {}, arch, launch.kernel)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch, 32),
            options=dataclasses.asdict(options),
        )
    log = _ptxas_log(compiled.asm["ptx"], arch, options.enable_fp_fusion)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = int(re.search(r"(\d+) bytes stack frame", log).group(1))
    tool = toolchain()["cuobjdump"]
    if tool:
        read = _res_usage(compiled.asm["cubin"], tool)
        if read["usage"].get("REG") != regs:  # the cubin Triton built and our ptxas -v run must agree
            raise RuntimeError(f"ptxas -v says {regs} registers, the cubin {read['usage']} (arch {arch})")
        loop, unit = sass_main_loop(read["sass"]), "SASS"
    else:
        loop, unit = ptx_main_loop(compiled.asm["ptx"]), "PTX"
    shared = compiled.metadata.shared
    warps = compiled.metadata.num_warps
    occ = occupancy(arch, regs, shared, warps)
    return Compiled(
        arch=arch,
        registers=regs,
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        stack=stack,
        shared=shared,
        warps=warps,
        stages=compiled.metadata.num_stages,
        loop_instructions=loop["loop_instructions"],
        loop_unit=unit,
        loop_ops=loop["loop_ops"],
        blocks_per_sm=occ["blocks_per_sm"],
        limited_by=occ["limited_by"],
        fits=occ["fits"],
    )
