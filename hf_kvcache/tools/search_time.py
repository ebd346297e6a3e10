"""How long ``key_bits="auto"``'s search takes on a model, replaying the layers a configuration cannot change and
running every layer: the two searches one after the other, their records compared.

Both run :func:`hf_kvcache.calibrate.search_key_bits` on the rows :func:`~hf_kvcache.calibrate.auto_key_bits`
searches (``AUTO_SEARCH``: random copy rows of the model's context or 1,024 tokens) under its budget, for the cache
``--cache`` names (``int2`` or ``int3`` and their options). Nothing is kept on disk. The replay must measure what
running every layer measures, to the bit: a difference is an error (exit code 1), not a speed.

    python benchmarks/search_time.py --model smollm2 --cache int2:residual_bits=8
"""

from __future__ import annotations

import argparse
import time

from ._probe import add_common_flags, run_model_probe

__all__ = ["main", "measure"]


def measure(model, cache: str, rows: int | None = None) -> dict:
    """Seconds of the search with the replay and without, their ratio, whether their records are equal, and the
    widths (``rows`` overrides ``AUTO_SEARCH``'s 4 rows)."""
    from ..calibrate import AUTO_SEARCH, auto_search_rows, search_key_bits
    from ..registry import check_spec, parse_spec

    check_spec(cache)
    kind, options = parse_spec(cache)
    if kind not in ("int2", "int3"):
        raise ValueError(f"--cache must be an int2 or int3 spec (key_bits='auto' searches those), got {cache!r}")
    bits = int(kind[3])
    scored = AUTO_SEARCH["scored_tokens"]
    ids = auto_search_rows(model, rows or AUTO_SEARCH["rows"])
    found, seconds = {}, {}
    for replay in (True, False):
        start = time.perf_counter()
        found[replay] = search_key_bits(
            model, ids, bits, bits + AUTO_SEARCH["extra_bits"], scored, replay=replay, **options
        )
        seconds[replay] = time.perf_counter() - start
    return {
        "cache": cache,
        "rows": list(ids.shape),
        "seconds_replay": seconds[True],
        "seconds_every_layer": seconds[False],
        "ratio": seconds[True] / seconds[False],
        "same_record": found[True] == found[False],
        "key_bits": list(found[True].key_bits),
    }


def table(result: dict) -> str:
    return "\n".join(
        [
            f"key_bits='auto' search for {result['cache']} on {result['rows'][0]} rows of {result['rows'][1]} tokens",
            "",
            "| search | seconds | x every layer |",
            "|---|---|---|",
            f"| replaying the layers before the narrowed one | {result['seconds_replay']:.1f} "
            f"| {result['ratio']:.2f} |",
            f"| every layer | {result['seconds_every_layer']:.1f} | 1.00 |",
            "",
            f"records equal: {result['same_record']}; widths {result['key_bits']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_flags(parser, None)
    parser.add_argument("--cache", default="int2", help="the int2 / int3 spec the widths are searched for")
    parser.add_argument("--rows", type=int, help="calibration rows (default: AUTO_SEARCH's 4)")
    args = parser.parse_args(argv)
    results = []

    def check() -> None:
        if args.rows is not None and args.rows < 1:
            raise ValueError(f"--rows must be >= 1, got {args.rows}")

    def run(model, tokenizer) -> dict:
        results.append(measure(model, args.cache, args.rows))
        return results[-1]

    code = run_model_probe(args, check, run, table)
    return 1 if code == 0 and not results[0]["same_record"] else code
