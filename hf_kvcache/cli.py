"""``hf-kvcache`` command line: ``list`` the cache kinds, ``demo``, ``eval`` and ``bench`` them.

Every subcommand defaults to the embedded reference model and runs offline; ``eval`` and ``bench`` need the ``eval``
extra (``hf_kvcache.eval``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _list(args) -> int:
    from .registry import available_caches

    for kind in available_caches().values():
        options = ", ".join(kind.options) or "-"
        print(f"{kind.name:<10} {kind.summary}\n{'':<10} options: {options}")
    return 0


def _demo(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .compare import analytic_ratio, compare_caches, format_table
    from .eval.runner import tokenize
    from .reference import reference_model_path, reference_text
    from .registry import check_spec

    specs = [s.strip() for s in args.caches.split(",") if s.strip()]
    for spec in specs:  # fail on a bad spec before loading anything
        check_spec(spec)
    torch.set_num_threads(args.threads)
    path = args.model or reference_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = reference_text()
    ids = tokenize(tokenizer, text[: 16 * args.prompt_tokens])[: args.prompt_tokens]
    if ids.numel() < args.prompt_tokens:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens} is longer than the demo text ({ids.numel()} tokens)")
    ids = ids.view(1, -1).repeat(args.batch, 1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    name = "the embedded reference model (4-layer Llama trained on Jane Austen)" if args.model is None else path
    threads = f"{args.threads} thread" + ("s" if args.threads != 1 else "")
    print(
        f"Greedy generation with {name}, float32 on CPU ({threads}): a {args.prompt_tokens}-token prompt "
        f"from the held-out text x batch {args.batch}, {args.new_tokens} new tokens, median of {args.repeats}.\n"
    )
    rows = compare_caches(model, inputs, specs, max_new_tokens=args.new_tokens, repeats=args.repeats)
    print(format_table(rows))
    print("\nAnalytic bytes per stored token vs a bf16 cache (residual excluded; bounded caches stop growing):")
    for spec in specs:
        ratio = analytic_ratio(model, spec, torch.bfloat16)
        print(f"  {spec:<24} " + ("bounded: stops at sinks + window tokens" if ratio != ratio else f"{ratio:.3f}"))
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
    continuation = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"\n...{tokenizer.decode(ids[0, -24:])!s}[{continuation.strip()}]")
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    return 0


def _eval(args) -> int:
    from .eval.report import format_eval_table, write_report
    from .eval.runner import EvalConfig, run_eval_distributed

    config = EvalConfig(
        model=args.model,
        dataset=args.dataset,
        caches=tuple(s.strip() for s in args.caches.split(",") if s.strip()),
        max_tokens=args.max_tokens,
        context=args.context,
        prefill=args.prefill,
        chunk=args.chunk,
        batch_size=args.batch_size,
        stream_tokens=args.stream_tokens,
        bucket=args.bucket,
        device=args.device,
        dtype=args.dtype,
        device_map=args.device_map,
        load_in_8bit=args.load_in_8bit,
        load_in_4bit=args.load_in_4bit,
        seed=args.seed,
        threads=args.threads,
        quiet=args.quiet,
    )
    results = run_eval_distributed(config)  # plain run_eval unless started by `accelerate launch`
    if results is None:  # a non-main process of a data-parallel run
        return 0
    print(format_eval_table(results))
    if args.output:
        command = "hf-kvcache " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("hf-kvcache") else None
        files = write_report(results, args.output, command)
        print(f"\nwrote {', '.join(files)} to {args.output}")
    return 0


def _bench(args) -> int:
    from .eval.bench import run_bench
    from .eval.report import format_bench_table, write_bench_report
    from .eval.runner import EvalConfig, load_model
    from .registry import check_spec, make_cache

    config = EvalConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads)
    config.validate()
    caches = [s.strip() for s in args.caches.split(",") if s.strip()]
    if not caches:
        raise ValueError("--caches must name at least one cache spec")
    for spec in caches:  # unknown kinds and options fail before the model loads
        check_spec(spec)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise ValueError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    if min(contexts) < 1:
        raise ValueError(f"--contexts must all be >= 1, got {args.contexts!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(config)
    for spec in caches:  # bad option values fail before any timing
        make_cache(spec, model.config)
    budget = int(args.memory_budget_gib * 2**30) if args.memory_budget_gib else None
    bench = run_bench(model, caches, contexts, args.new_tokens, args.batch, args.repeats, budget)
    print(format_bench_table(bench))
    if args.output:
        print(f"\nwrote {', '.join(write_bench_report(bench, args.output))} to {args.output}")
    return 0


def _add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time to first token and decode speed at several context lengths, side by side",
        description="Generate from random prompts of each --contexts length with each cache: warm-up, then "
        "--repeats timed runs; medians and spread. On CUDA also peak memory and the largest context per budget.",
    )
    p.add_argument("--model", default=None, help="hub id or local path (default: the embedded reference model)")
    p.add_argument("--caches", default="dynamic,int8,int4,sink:window=256:sinks=4,paged:block_size=16")
    p.add_argument("--contexts", default="256,1024,4096", help="comma-separated prompt lengths")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-budget-gib", type=float, default=None, help="CUDA: report the largest context per cache")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="directory for bench.json, bench.md and bench.png")
    p.set_defaults(func=_bench)


def _add_eval_parser(sub) -> None:
    from .eval.data import DATASET_HELP
    from .eval.runner import DEFAULT_CACHES, EvalConfig

    d = EvalConfig()
    p = sub.add_parser(
        "eval",
        help="perplexity through each cache, bytes and decode speed, side by side",
        description="Score a text through each cache (windows of --context tokens: --prefill tokens in one forward, "
        "the rest --chunk tokens per forward, scored). Defaults run offline on the embedded reference model.",
    )
    p.add_argument("--model", default=None, help="hub id or local path (default: the embedded reference model)")
    p.add_argument("--dataset", default=None, help=DATASET_HELP)
    p.add_argument(
        "--caches",
        default=",".join(DEFAULT_CACHES),
        help="comma-separated make_cache specs; the first is the baseline of the change columns",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="cut the text to this many tokens")
    p.add_argument("--context", type=int, default=d.context, help="tokens per window")
    p.add_argument("--prefill", type=int, default=d.prefill, help="unscored tokens per window, one forward")
    p.add_argument("--chunk", type=int, default=d.chunk, help="tokens per scored forward (1: pure decode)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows scored together")
    p.add_argument(
        "--stream-tokens",
        type=int,
        default=0,
        help="also score one stream of this many tokens through "
        "one cache per kind and report perplexity per --bucket positions (long-stream mode)",
    )
    p.add_argument("--bucket", type=int, default=d.bucket, help="positions per bucket in long-stream mode")
    p.add_argument("--device", default=d.device, help="cpu, cuda or auto")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None, help="'auto': accelerate splits the model across devices")
    p.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes 8-bit weights (with any KV cache)")
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes 4-bit weights (with any KV cache)")
    p.add_argument("--output", default=None, help="directory for results.json, report.md and plots")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcache", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered cache kinds and their options").set_defaults(func=_list)
    demo = sub.add_parser(
        "demo", help="offline side-by-side generation with several caches on the embedded reference model"
    )
    demo.add_argument(
        "--caches",
        default="dynamic,int8,int4,int2,sink:window=128:sinks=4,paged",
        help="comma-separated make_cache specs; the first is the reference the others are compared with",
    )
    demo.add_argument("--model", default=None, help="local path or hub id (default: the embedded reference model)")
    demo.add_argument("--prompt-tokens", type=int, default=384)
    demo.add_argument("--new-tokens", type=int, default=64)
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--threads", type=int, default=1)
    demo.add_argument("--json", action="store_true", help="also print the rows as JSON")
    demo.set_defaults(func=_demo)
    _add_eval_parser(sub)
    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("prompt_tokens", "new_tokens", "batch", "repeats", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"hf-kvcache: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except ValueError as err:
        print(f"hf-kvcache: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
