"""``hf-kvcache`` command line: ``list`` the cache kinds, run the offline ``demo``.

The evaluation subcommands (``eval``, ``bench``) arrive with the harness.
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
    from .compare import analytic_ratio, compare_caches, format_table, tiny_llama

    torch.set_num_threads(args.threads)
    model = tiny_llama(head_dim=args.head_dim, layers=args.layers)
    ids = torch.randint(
        3, model.config.vocab_size, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
    )
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    specs = [s.strip() for s in args.caches.split(",") if s.strip()]
    print(
        f"Greedy generation on a random {args.layers}-layer Llama (head_dim {args.head_dim}, GQA 4/2, float32, CPU "
        f"threads {args.threads}): prompt {args.prompt_tokens} tokens x batch {args.batch}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}. Random weights have near-tied logits, so a changed "
        "token is expected now and then; the trained reference model replaces this one.\n"
    )
    rows = compare_caches(model, inputs, specs, max_new_tokens=args.new_tokens, repeats=args.repeats)
    print(format_table(rows))
    print("\nAnalytic bytes per stored token vs a bf16 cache (residual excluded):")
    for spec in specs:
        print(f"  {spec:<10} {analytic_ratio(model, spec, torch.bfloat16):.3f}")
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered cache kinds and their options").set_defaults(func=_list)
    demo = sub.add_parser("demo", help="offline side-by-side generation with several caches on a tiny random model")
    demo.add_argument("--caches", default="dynamic,int8,int4,int2", help="comma-separated make_cache specs")
    demo.add_argument("--prompt-tokens", type=int, default=512)
    demo.add_argument("--new-tokens", type=int, default=64)
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--threads", type=int, default=1)
    demo.add_argument("--json", action="store_true", help="also print the rows as JSON")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("prompt_tokens", "new_tokens", "batch", "head_dim", "layers", "repeats", "threads"):
        if getattr(args, name, 1) < 1:
            print(f"hf-kvcache: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except ValueError as err:
        print(f"hf-kvcache: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
