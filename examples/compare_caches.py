"""Compare caches from Python with the evaluation harness: perplexity and copying through each cache, bytes, speed.

The same measurement as ``hf-kvcache eval``, called as a library: an ``EvalConfig`` names the tasks, the caches
(spec strings, as ``make_cache`` takes them) and the text; ``run_eval`` runs each task through each cache on the
default model (SmolLM2-135M-Instruct when installed). ``perplexity`` scores the text in windows of ``--context``
tokens (the first ``--prefill`` go in with one forward, the rest one token at a time through the cache); ``repeat``
shows a passage, other text, then the passage again, and scores the second copy through the cache: what the cache
kept of the first copy is all the model can copy from. The script prints one table per task and writes
``results.json``, ``report.md`` and plots into ``--output``.

Run it with::

    python examples/compare_caches.py
    python examples/compare_caches.py --caches dynamic,int8,int2 --max-tokens 8192 --output /tmp/compare

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache, and the text
is Persuasion, the novel held out from its training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from hf_kvcache.eval import EvalConfig, format_eval_table, run_eval, write_report

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
CACHES = "dynamic,int8,int4,sink:window=128:sinks=4,paged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default=CACHES, help="comma-separated specs; the first is the baseline")
    parser.add_argument("--max-tokens", type=int, default=512 if SMALL else 4096, help="tokens of the text scored")
    parser.add_argument("--context", type=int, default=256 if SMALL else 512, help="tokens per window")
    parser.add_argument("--prefill", type=int, default=128 if SMALL else 256, help="unscored tokens per window")
    parser.add_argument("--output", default="results/compare-caches", help="folder for results.json and report.md")
    args = parser.parse_args()

    config = EvalConfig(
        task=("perplexity", "repeat"),
        caches=tuple(spec.strip() for spec in args.caches.split(",")),
        max_tokens=args.max_tokens,
        context=args.context,
        prefill=args.prefill,
        distances=(0, 256) if SMALL else (0, 512, 1500),  # tokens of other text between the two copies
        samples=2 if SMALL else 8,
        model="reference" if SMALL else None,  # None: SmolLM2 when installed (the embedded 4M model for quick runs)
        quiet=True,  # no progress bars: the tables are the output
    )
    start = time.perf_counter()
    results = run_eval(config)  # dataset=None: the held-out text
    print(f"{len(config.caches)} caches scored in {time.perf_counter() - start:.1f} s on {results['device']}\n")
    print(format_eval_table(results))

    # The report records the command line, so that it says how to reproduce it.
    command = shlex.join(["python", "examples/compare_caches.py", *sys.argv[1:]])
    files = write_report(results, args.output, command=command)
    print(f"\nwrote {', '.join(files)} to {args.output}")


if __name__ == "__main__":
    main()
