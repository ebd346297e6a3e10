"""``hf-kvcache`` command line: ``list`` the cache kinds, ``demo``, ``eval`` and ``bench`` them, ``plan`` memory.

``calibrate`` measures per-layer key widths for ``key_bits=``; ``report`` renders a saved eval run again, any of its
caches the baseline.

Every subcommand defaults to the embedded reference model and runs offline; ``eval`` and ``bench`` need the ``eval``
extra (``hf_kvcache.eval``). ``eval`` and ``bench`` take flags generated from their config dataclasses. Expected
failures (a bad flag value, a missing model or dataset, no CUDA) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from ._validate import check_int

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class _UsageError(ValueError):
    """A flag argparse could not take (unknown flag, bad value, missing argument)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised so that :func:`main` prints them on one line like every expected failure."""

    def error(self, message: str):
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _list(args) -> int:
    from .registry import available_caches

    for kind in available_caches().values():
        options = ", ".join(kind.options) or "-"
        print(f"{kind.name:<10} {kind.summary}\n{'':<10} options: {options}")
    return 0


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(_split(args.caches), args.model, args.document_tokens, args.new_tokens, args.threads, as_json=args.json)
    return 0


def _output_flag(parser, what: str) -> None:
    parser.add_argument("--output", default=None, metavar="DIR", help=f"directory for {what} (default: none)")


def _show_eval(results: dict, output: str | None) -> int:
    """Print an eval's tables; with ``output``, write its report there, recording the command line that made it."""
    from .eval.report import format_eval_table, write_report

    print(format_eval_table(results))
    if output:
        command = "hf-kvcache " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("hf-kvcache") else None
        files = write_report(results, output, command)
        print(f"\nwrote {', '.join(files)} to {output}")
    return 0


def _add_eval_parser(sub) -> None:
    from .eval.flags import add_flags

    p = sub.add_parser(
        "eval",
        help="what each cache costs: perplexity, passkey retrieval and copying through the cache, bytes and speed",
        description="Run --task through each of --caches on --model (default: the embedded reference model, "
        "offline): perplexity of a text in windows scored through the cache, a long stream through one cache, passkey "
        "retrieval, and copying a repeated passage. Prints one table per task; --output adds results.json, "
        "report.md and plots.",
    )
    from .eval.config import ModelOptions, RunOptions
    from .eval.tasks import TASKS, option_owners

    # Every flag from a dataclass: the shared options, then each registered task's (an option two tasks share is
    # one flag, in the first owner's group, its help naming every owner).
    add_flags(p.add_argument_group("model options"), ModelOptions)
    add_flags(
        p.add_argument_group("run options"),
        RunOptions,
        helps={"task": f"tasks to run, comma-separated: {', '.join(TASKS)}"},
    )
    owners, added = option_owners(), set()
    for name, task in TASKS.items():
        if task.options is None:
            continue
        helps = {
            f.name: "; ".join(f"{o}: {TASKS[o].options.__dataclass_fields__[f.name].metadata['help']}" for o in owned)
            for f in dataclasses.fields(task.options)
            if len(owned := owners[f.name]) > 1
        }
        group = p.add_argument_group(f"{name} task options")
        added |= set(add_flags(group, task.options, skip=tuple(added), helps=helps))
    _output_flag(p, "results.json, report.md and plots (created and checked before any work)")
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    from .eval.config import EvalConfig, ModelOptions, RunOptions
    from .eval.flags import given_fields
    from .eval.report import check_output
    from .eval.runner import run_eval_distributed
    from .eval.tasks import option_owners

    owners = option_owners()
    shared = [f.name for cls in (ModelOptions, RunOptions) for f in dataclasses.fields(cls)]
    given = given_fields(args, shared + list(owners))
    config = EvalConfig(**given)
    for name in given:
        tasks = owners.get(name, ())
        if tasks and not set(tasks) & set(config.task):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is an option of --task {' or '.join(tasks)}, which this run does not include")
    config.validate()  # every flag before the output folder, the model and the first document
    if args.output:
        check_output(args.output)
    results = run_eval_distributed(config)  # plain run_eval unless started by `accelerate launch`
    if results is None:  # a non-main process of a data-parallel run
        return 0
    return _show_eval(results, args.output)


def _add_report_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="a saved eval run's tables again, any of its caches the baseline (no model run)",
        description="Print the tables of a saved eval run again: RESULTS is its results.json, the --output folder "
        "holding it, or a run saved under docs/results/. Several runs of the same documents (the same settings "
        "but their caches) join: every run's caches side by side, a cache two runs hold checked to agree. Several "
        "runs of other documents (other lengths, depths, RULER tasks or --seed values) pool their retrieval cells "
        "into one table. --caches chooses which of its caches and in which order, the "
        "first the baseline: perplexity and copy changes, bytes ratios and retrieval points with their paired "
        "intervals are recomputed against it from what each cache measured (every cache of a run read the same "
        "documents). --output writes report.md, results.json and plots for that selection.",
    )
    p.add_argument(
        "results",
        metavar="RESULTS",
        nargs="+",
        help="results.json, the folder holding it, or docs/results/NAME.json; several: joined (the same documents) "
        "or their retrieval cells pooled (other lengths, depths, RULER tasks or seeds)",
    )
    p.add_argument(
        "--caches",
        default=None,
        metavar="A,B,...",
        help="caches of the run, spelled as the run names them, comma-separated; the first is the baseline "
        "(default: the run's, in its order)",
    )
    _output_flag(p, "report.md, results.json and plots of the selection")
    p.set_defaults(func=_report)


def _report(args) -> int:
    from .eval.report import check_output, load_results, results_file
    from .eval.runner import combine_runs

    runs = [load_results(path) for path in args.results]
    results = combine_runs(runs, None if args.caches is None else _split(args.caches))
    if args.output:
        written = Path(args.output).expanduser().resolve() / "results.json"
        for path in args.results:
            if results_file(path).resolve() == written:
                raise ValueError(f"--output {args.output!r} holds {path}, which this report would replace")
        check_output(args.output)
    return _show_eval(results, args.output)


def _add_bench_parser(sub) -> None:
    from .eval.bench import BenchConfig
    from .eval.config import ModelOptions
    from .eval.flags import add_flags

    p = sub.add_parser(
        "bench",
        help="time to first token and decode speed at several context lengths, side by side",
        description="Generate from random prompts of each --contexts length with each cache: warm-up, then "
        "--repeats timed runs, each step timed; medians and spread; peak memory (CUDA: allocator statistics; CPU: "
        "tracked tensor bytes); with --memory-budget-gib the largest context per cache that fits, found by running.",
    )
    names = add_flags(p.add_argument_group("model options"), ModelOptions)
    names += add_flags(p.add_argument_group("bench options"), BenchConfig)
    _output_flag(p, "bench.json, bench.md and bench.png")
    p.set_defaults(func=_bench, names=names)


def _bench(args) -> int:
    from .eval.bench import BenchConfig, default_contexts, run_bench, trained_context
    from .eval.flags import given_fields
    from .eval.report import check_output, format_bench_table, write_bench_report
    from .eval.runner import load_configured_model
    from .registry import make_cache

    config = BenchConfig(**given_fields(args, args.names))
    config.validate()  # bad specs, contexts and counts fail before the model loads
    if args.output:
        check_output(args.output)  # an unwritable --output fails now, not after every timing
    if config.threads:
        torch.set_num_threads(config.threads)
    model, _ = load_configured_model(config)
    for spec in config.caches:  # bad option values fail before any timing
        make_cache(spec, model.config)
    contexts = config.contexts or default_contexts(model.config, config.new_tokens)
    limit = trained_context(model.config)
    beyond = [c for c in contexts if limit and c + config.new_tokens > limit]
    if beyond:
        print(
            f"note: contexts {', '.join(map(str, beyond))} (+{config.new_tokens} new tokens) run past the model's "
            f"trained context ({limit} tokens): positions there are out of distribution; speed is still measured.",
            file=sys.stderr,
        )
    budget = int(config.memory_budget_gib * 2**30) if config.memory_budget_gib else None
    attns = list(config.attn) if config.attn else None
    bench = run_bench(
        model, list(config.caches), list(contexts), config.new_tokens, config.batch, config.repeats, budget, attns=attns
    )
    print(format_bench_table(bench))
    if args.output:
        print(f"\nwrote {', '.join(write_bench_report(bench, args.output))} to {args.output}")
    return 0


def _add_demo_parser(sub) -> None:
    from .demo import DEMO_CACHES

    demo = sub.add_parser(
        "demo",
        help="offline side by side: each cache's answers to a long-context question and chat prompts, bytes, speed",
        description="Greedy decoding through each cache on the default model (SmolLM2-135M-Instruct when installed): "
        "a question about a fact stated once early in a long document (answer, found or not, bytes held, TTFT, decode "
        "rate), then short chat prompts as one left-padded batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--caches",
        default=",".join(DEMO_CACHES),
        help="comma-separated make_cache specs; the first is the baseline the others are compared with",
    )
    demo.add_argument(
        "--model", default=None, help="smollm2, reference or a local folder (default: smollm2 when installed)"
    )
    demo.add_argument("--document-tokens", type=int, default=2000, help="length of the long-context document")
    demo.add_argument("--new-tokens", type=int, default=32, help="most tokens generated per answer")
    demo.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    demo.add_argument("--json", action="store_true", help="also print the rows as JSON")
    demo.set_defaults(func=_demo)


def _add_plan_parser(sub) -> None:
    from .plan import DEFAULT_PLAN_CACHES

    p = sub.add_parser(
        "plan",
        help="what fits in memory: KV bytes per token, largest context and batch per cache, from the config alone",
        description="Per cache spec: KV bytes per token, bytes at --batch x --context, and the largest context (at "
        "--batch) and batch (at --context) that fit in --memory after the weights and a reserve. Reads only the "
        "model's config: a local folder, a config.json or a hub id (offline: local files).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="smollm2, reference, a folder, a config.json or a hub id (default: smollm2 when installed)",
    )
    p.add_argument("--memory", required=True, help="device memory, e.g. 24GiB, 80GB")
    p.add_argument("--context", type=int, default=None, help="tokens per row (default: the model's max positions)")
    p.add_argument("--batch", type=int, default=1, help="rows")
    p.add_argument("--dtype", default="bfloat16", help="weights and K/V dtype: bfloat16, float16, float32")
    p.add_argument("--weights-bits", type=int, default=16, help="16, 8 or 4 (bitsandbytes)")
    p.add_argument("--reserve", default=None, help="memory kept for activations, CUDA context (1GiB + 5%%)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: plan one rank's share of the KV heads")
    p.add_argument(
        "--attn",
        default="sdpa",
        help="attention decoding will use: eager or sdpa (quantized caches need a dequantization workspace) or "
        "hf_kvcache (codes read in place: no workspace)",
    )
    p.add_argument(
        "--caches",
        default=None,
        help=f"cache specs, comma-separated (default: {','.join(DEFAULT_PLAN_CACHES)}, less those the model refuses, "
        "said under the table)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)


def _plan(args) -> int:
    import dataclasses
    import json

    from ._validate import dtype_from_name
    from .models import model_path
    from .plan import PLAN_ATTENTIONS, parse_memory, plan_memory

    # Checked here with the flags' names in the messages; plan_memory checks them again under its argument names.
    if args.weights_bits not in (4, 8, 16):
        raise ValueError(f"--weights-bits must be 16, 8 or 4, got {args.weights_bits}")
    if args.context is not None:
        check_int("--context", args.context, 1)
    check_int("--batch", args.batch, 1)
    check_int("--tp", args.tp, 1)
    if args.attn not in PLAN_ATTENTIONS:
        raise ValueError(f"--attn must be one of {', '.join(PLAN_ATTENTIONS)}, got {args.attn!r}")
    dtype = dtype_from_name("--dtype", args.dtype)
    for flag, value in (("--memory", args.memory), ("--reserve", args.reserve)):
        if value is not None:
            parse_memory(value, flag)
    plan = plan_memory(
        model_path(args.model),
        args.memory,
        context=args.context,
        batch=args.batch,
        dtype=dtype,
        weights_bits=args.weights_bits,
        caches=None if args.caches is None else _split(args.caches),
        reserve=args.reserve,
        tp=args.tp,
        attn=args.attn,
    )
    print(json.dumps(dataclasses.asdict(plan), indent=1) if args.json else plan.table())
    return 0


def _add_calibrate_parser(sub) -> None:
    from .eval.calibration import CalibrateConfig
    from .eval.config import ModelOptions
    from .eval.flags import add_flags

    p = sub.add_parser(
        "calibrate",
        help="per-layer key widths under a bits budget, measured on the model (a file for key_bits=)",
        description="Measure what each layer's keys cost at 2, 3 and 4 bits (KL of next-token distributions against "
        "a full-precision cache, on rows whose tail copies their beginning), choose the widths with the least loss "
        "within --budget key bits on average, and write them to --output: use it as "
        "QuantizedKVCache(key_bits=FILE) or the spec int2:key_bits=FILE.",
    )
    names = add_flags(p.add_argument_group("model options"), ModelOptions, skip=("seed",))
    names += add_flags(p.add_argument_group("calibrate options"), CalibrateConfig)
    p.set_defaults(func=_calibrate, names=names)


def _calibrate(args) -> int:
    from .eval.calibration import CalibrateConfig, format_widths, run_calibration
    from .eval.flags import given_fields

    config = CalibrateConfig(**given_fields(args, args.names))
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    widths = run_calibration(config)
    print(format_widths(widths))
    print(f"\nwrote {config.output}: use it as key_bits={config.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-kvcache", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered cache kinds and their options").set_defaults(func=_list)
    _add_demo_parser(sub)
    _add_eval_parser(sub)
    _add_report_parser(sub)
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    _add_calibrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT, nothing half-written left behind
        print("hf-kvcache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, ImportError, OSError) as err:  # expected failures: one line, no traceback
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"hf-kvcache: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
