"""Produce the docs' results from the harness, and keep the pages in step with them.

The docs quote harness output in *results regions*::

    <!-- results:eval-default -->
    ...the command and its table(s), written by this script...
    <!-- /results -->

Each region names a run in ``RUNS``. ``--run`` runs the CLI for the named runs (all by default), writes the full
report under ``results/NAME/`` (not committed) and saves ``docs/results/NAME.json`` (committed on purpose: the
command, the kind of run and the harness's results). ``--write`` rewrites every region from those files. The docs
build (``scripts/mkdocs_hooks.py``) fails when a region differs from its file, and draws the plots from the same
files, so a page can never quote numbers the harness did not produce.

Usage::

    python scripts/build_results.py --run            # every run (about 15 minutes on a 2-core CPU), then --write
    python scripts/build_results.py --run eval-default
    python scripts/build_results.py --write          # only re-render the regions
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (a checkout: tools read and write its docs)
DOCS = ROOT / "docs"
SAVED = DOCS / "results"
REGION = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)

# Every published run is on the real model (SmolLM2-135M-Instruct, `--model smollm2`), with 1 thread.
REAL = ["--model", "smollm2", "--threads", "1"]
EVAL_CACHES = "dynamic,int8,int4,int2,sink:window=256:sinks=4"
LONG_CACHES = "dynamic,int4,int2,sink:window=1024:sinks=4"
STREAM_CACHES = "dynamic,sink:window=1024:sinks=0,sink:window=1024:sinks=4"
# KVQuant / QuaRot options at 4, 3 and 2 bits, each named in full so the specs mean the same whatever the defaults:
# KIVI's layout, each option alone, the rotation with sinks, and all three.
ABLATION_OPTIONS = (
    "rotate=none:sinks=0:pre_rope=false",
    "rotate=hadamard:sinks=0:pre_rope=false",
    "rotate=none:sinks=0:pre_rope=true",
    "rotate=none:sinks=4:pre_rope=false",
    "rotate=hadamard:sinks=4:pre_rope=false",
    "rotate=hadamard:sinks=4:pre_rope=true",
)
_ROT_SINKS = "int2:rotate=hadamard:sinks=4:pre_rope=false"
# The RULER tasks of the runs made before fwe joined the suite's default (named, so their commands still reproduce them)
RULER_SIX = ["--ruler-tasks", "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe"]
ABLATION_CACHES = ",".join(f"int{b}:{o}" for b in (4, 3, 2) for o in ABLATION_OPTIONS)
BENCH = [
    *"--new-tokens 8 --repeats 1 --caches".split(),
    "dynamic,int8,int4,int2,sink:window=1024:sinks=4,paged:block_size=16",
]
SMOOTH_CACHES = (
    "dynamic,int2,int2:smooth=0.5,int2:smooth=1,int2:smooth=1.5,int2:smooth=2,int3,int3:smooth=0.5,int3:smooth=1,"
    "int2:key_bits=3:smooth=1"
)
KEY_WIDTHS_FILE = "results/{}/key_bits.json"  # where a calibrate run writes its widths (relative to the checkout)
KEYWIDTHS_225 = f"int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2-2.25')}"
# int2 with the key widths the cache searches for itself (key_bits="auto") and an int8 residual
AUTO_INT2 = "int2:key_bits=auto:residual_bits=8"
# (name suffix, length, documents a cell, seed) of the calibrated widths' RULER runs at further seeds
KEYWIDTHS_SEEDS = [
    ("", 1024, 10, 10),
    ("-2k", 2048, 10, 10),
    ("-4k", 4096, 5, 5),
    ("", 1024, 10, 20),
    ("-2k", 2048, 10, 20),
    ("", 1024, 10, 30),
]
KEYWIDTHS_POOLED = [
    "eval-ruler-keywidths-residual",
    "eval-ruler-keywidths-residual-2k",
    "eval-ruler-keywidths-residual-4k",
    *(f"eval-ruler-keywidths-residual{suffix}-seed{seed}" for suffix, _, _, seed in KEYWIDTHS_SEEDS),
]
# int4's layouts measured on RULER's needles (report-ruler-int4): KIVI's (the default then), 4 sinks, the rotation
# alone, with sinks, with sinks and 8-bit scales (the default since), with sinks and pre-RoPE keys (int3's layout).
INT4_LAYOUTS = (  # every option spelled out: the same caches whatever int4's defaults
    "dynamic",
    "int4:rotate=none:sinks=0",
    "int3",
    "int4:rotate=none:sinks=4",
    "int4:rotate=hadamard:sinks=0:scale_dtype=none",
    "int4:rotate=hadamard:sinks=4:scale_dtype=none",
    "int4:rotate=hadamard:sinks=4:scale_dtype=e5m3",
    "int4:rotate=hadamard:sinks=4:pre_rope=true:scale_dtype=none",
)
_INT4_KIVI = ",".join(INT4_LAYOUTS[:3])
_INT4_SINKS = ",".join(["dynamic", INT4_LAYOUTS[3], INT4_LAYOUTS[7]])
_INT4_ROTATED = ",".join(["dynamic", *INT4_LAYOUTS[4:7]])
INT4_RULER_RUNS = (  # (name suffix, seed suffix, seed, caches)
    ("", "", 0, _INT4_KIVI),
    ("-sinks", "", 0, _INT4_SINKS),
    ("-rotated", "", 0, _INT4_ROTATED),
    ("", "-seed50", 50, ",".join([*INT4_LAYOUTS[:4], INT4_LAYOUTS[7]])),
    ("-rotated", "-seed50", 50, _INT4_ROTATED),
)

INT3_OPTIONS = ("int3:smooth=1", "int3:group_size=32", "int3:key_bits=4", "int3:boundary_layers=2")

RUNS: dict[str, list[str]] = {
    "eval-default": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", EVAL_CACHES],
    ],
    "eval-passkey": [
        "eval",
        *REAL,
        *"--task passkey --lengths 1024,2048,4096,8000 --depths 0,0.5,1 --samples 1".split(),
        *["--caches", LONG_CACHES],
    ],
    "eval-passkey-chat": [
        "eval",
        *REAL,
        *"--task passkey --chat-template --lengths 1024,2048,4096,8000 --depths 0,0.5,1 --samples 1".split(),
        *["--caches", "dynamic"],
    ],
    "eval-repeat": ["eval", *REAL, *"--task repeat --distances 0,1000,3000,7000".split(), "--caches", LONG_CACHES],
    # fp8 e4m3 next to int8 (the same bytes) on the default run's protocol.
    "eval-fp8": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int8,fp8"],
    ],
    # int2 with its first and last layers in int8 (boundary_layers), next to int2, on the default run's protocol.
    "eval-boundary": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int2,int2:boundary_layers=1,int2:boundary_layers=2,int2:boundary_layers=4"],
    ],
    # Keys and values at their own widths (key_bits), next to the uniform widths of the same bytes, on the default
    # run's protocol: int2:key_bits=4 and int3 store 3 bits per element, int2:key_bits=3 2.5, int3:key_bits=4 3.5.
    "eval-kvbits": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int2,int2:key_bits=3,int2:key_bits=4,int3,int3:key_bits=4,int4:key_bits=2"],
    ],
    # int2 with smaller groups (group_size: tokens per key group, channels per value group), next to int2's default
    # 64 and the one more key bit that is the step up before int3, on the default run's protocol.
    "eval-groups": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int2,int2:group_size=32,int2:group_size=16,int2:key_bits=3,int3"],
    ],
    # Per-layer key widths (hf-kvcache calibrate): measured once at int2 (budget 2.5 key bits), re-chosen from the same
    # measurements for 2.25 and 2.1 bits; then the default run's protocol with each, int2 and int2:key_bits=3 beside.
    # The eval reads the files the calibrate runs write under results/ (run them first: RUNS order).
    "calibrate-int2": ["calibrate", *REAL, *"--cache int2 --budget 2.5".split()],
    "calibrate-int2-2.25": ["calibrate", "--reuse", KEY_WIDTHS_FILE.format("calibrate-int2"), "--budget", "2.25"],
    "calibrate-int2-2.1": ["calibrate", "--reuse", KEY_WIDTHS_FILE.format("calibrate-int2"), "--budget", "2.1"],
    # The search again with today's defaults (8-bit scales) and an int8 residual, at 2.25 key bits: what a user
    # following the docs' recipe for int2:key_bits=FILE:residual_bits=8 measures.
    "calibrate-int2-residual": ["calibrate", *REAL, *"--cache int2:residual_bits=8 --budget 2.25".split()],
    # The same search from the model alone (rows of random token ids, no text), then the default run's protocol with
    # its widths; hf-kvcache report joins it with eval-keywidths-residual (the same documents).
    "calibrate-int2-random": [
        "calibrate",
        *REAL,
        *"--cache int2:residual_bits=8 --budget 2.25 --random-tokens".split(),
    ],
    "eval-keywidths-random": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", f"dynamic,int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2-random')}:residual_bits=8"],
    ],
    "eval-keywidths": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        "--caches",
        ",".join(
            [
                "dynamic",
                "int2",
                *(f"int2:key_bits={KEY_WIDTHS_FILE.format(n)}" for n in ("calibrate-int2-2.1", "calibrate-int2-2.25")),
                f"int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2')}",
                "int2:key_bits=3",
            ]
        ),
    ],
    # RULER through the calibrated widths at 2.25 key bits (beside eval-ruler-kvbits' int2 and int2:key_bits=3).
    "eval-ruler-keywidths": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024,2048 --ruler-samples 10".split(),
        *RULER_SIX,
        *["--caches", f"dynamic,{KEYWIDTHS_225}"],
    ],
    # RULER at twice the longest length above (4,096 tokens), every default width; 5 documents a cell (35 a cache).
    "eval-ruler-4k": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 4096 --ruler-samples 5".split(),
        *["--caches", "dynamic,int8,int4,int3,int2"],
    ],
    # 3-bit keys beside 2-bit values (int2:key_bits=3) on the 4,096-token protocol above.
    "eval-ruler-4k-kvbits": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 4096 --ruler-samples 5".split(),
        *["--caches", "dynamic,int2:key_bits=3"],
    ],
    # RULER at the longest length SmolLM2's 8,192-token context holds with its answer (8,000 tokens), every default
    # width and 3-bit keys beside int2; 5 documents a cell (35 a cache).
    "eval-ruler-8k": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 8000 --ruler-samples 5".split(),
        *["--caches", "dynamic,int8,int4,int3,int2,int2:key_bits=3"],
    ],
    # The four needle tasks at 1k with enough documents (50 a task) for the paired interval to tell int4 and int3
    # from DynamicCache within a couple of points.
    "eval-ruler-paired": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 50".split(),
        *"--ruler-tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery".split(),
        *["--caches", "dynamic,int4,int3"],
    ],
    # int4's layouts on the same four needle tasks, 8 documents answered at a time (exactly 1,024 tokens: no padding,
    # so each answer is the one-at-a-time run's), on eval-ruler-paired's documents (seed 0) and 200 more (seed 50),
    # pooled by report-ruler-int4.
    **{
        f"eval-ruler-int4{suffix}{seed_suffix}": [
            "eval",
            *REAL,
            *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 50".split(),
            *"--ruler-tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --generate-batch 8".split(),
            *(["--seed", str(seed)] if seed else []),
            *["--caches", caches],
        ]
        for suffix, seed_suffix, seed, caches in INT4_RULER_RUNS
    },
    "report-ruler-int4": [
        "report",
        *(f"docs/results/eval-ruler-int4{suffix}{seed_suffix}.json" for suffix, seed_suffix, _, _ in INT4_RULER_RUNS),
        *["--caches", ",".join(INT4_LAYOUTS)],
    ],
    # int3 with more bytes where RULER's needles may need them, on report-ruler-int4's documents (seeds 0 and 50, 8
    # answered at a time), joined with its DynamicCache and int3: smoothed keys (no more bytes), key groups of 32
    # tokens, 4-bit keys (3.5 bits an element), and the first and last two layers in int8.
    **{
        f"eval-ruler-int3{seed_suffix}": [
            "eval",
            *REAL,
            *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 50".split(),
            *"--ruler-tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --generate-batch 8".split(),
            *(["--seed", str(seed)] if seed else []),
            *["--caches", ",".join(INT3_OPTIONS)],
        ]
        for seed_suffix, seed in (("", 0), ("-seed50", 50))
    },
    "report-ruler-int3": [
        "report",
        *(f"docs/results/{name}.json" for name in ("eval-ruler-int4", "eval-ruler-int4-seed50")),
        *(f"docs/results/eval-ruler-int3{seed_suffix}.json" for seed_suffix in ("", "-seed50")),
        *["--caches", ",".join(["dynamic", "int3", *INT3_OPTIONS])],
    ],
    # int4's layouts on the default run's documents (perplexity, copies, passkeys; joins eval-default): KIVI's, the
    # rotation alone, with sinks, and the default (with sinks and 8-bit scales).
    "eval-int4-layouts": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", ",".join(["dynamic", INT4_LAYOUTS[1], *INT4_LAYOUTS[4:6], "int4"])],
    ],
    # Frequent-words extraction (fwe, the task added after the RULER runs above) at their lengths and sample count,
    # every default width and 3-bit keys beside int2.
    "eval-ruler-fwe": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024,2048 --ruler-samples 10 --ruler-tasks fwe".split(),
        *["--caches", "dynamic,int8,int4,int3,int2,int2:key_bits=3"],
    ],
    # --generate-batch: RULER's documents answered 8 at a time (left-padded) against one at a time, the same
    # documents and caches, run side by side: the wall time it saves, and what padding moves in the lossy caches.
    **{
        f"eval-ruler-batch{size}": [
            "eval",
            *REAL,
            *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 8".split(),
            *["--caches", "dynamic,int4,int2", "--generate-batch", str(size)],
        ]
        for size in (1, 8)
    },
    # The residual in int8 (residual_bits=8) next to the full-precision residual, on the default run's protocol.
    "eval-residual": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int2:residual_bits=none,int2:residual_bits=8,int3,int3:residual_bits=8"],
    ],
    # An int8 residual of 64 tokens (64 to 127 held) against 128 (128 to 191), both in int8, on the default run's
    # protocol: the residual is what keeps int2 above 0.16x of DynamicCache's bytes at 8k tokens.
    "eval-residual-length": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *[
            "--caches",
            "dynamic,int2:residual_bits=8,int2:residual_bits=8:residual_length=64,int3:residual_bits=8,"
            "int3:residual_bits=8:residual_length=64",
        ],
    ],
    # Lloyd-Max levels (codebook=lloyd) next to the uniform grid at 2 and 3 bits, on the default run's protocol.
    "eval-codebook": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", "dynamic,int2,int2:codebook=lloyd,int3,int3:codebook=lloyd,int2:key_bits=3:codebook=lloyd"],
    ],
    # Smoothed keys (smooth=): strengths 0.5 to 2 at 2 bits, 0.5 and 1 at 3 bits and beside 3-bit keys, in the default
    # run's protocol; then RULER's suite at the RULER runs' lengths and samples.
    "eval-smooth": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", SMOOTH_CACHES],
    ],
    # 8-bit scales and zero points (int3 / int2's default since 2026-11-29, scale_dtype=e5m3) beside 16-bit ones
    # (scale_dtype=none) at 4, 3 and 2 bits, and with an int8 residual too, on the default run's protocol.
    "eval-scales": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *[
            "--caches",
            "dynamic,int2:scale_dtype=none,int2,int2:residual_bits=8,int3:scale_dtype=none,int3,int3:residual_bits=8,"
            "int4,int4:scale_dtype=e5m3",
        ],
    ],
    # int2's 8-bit scales against 16-bit ones on RULER's suite at 1,024 tokens (the smoothed keys' runs' samples).
    "eval-ruler-scales": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 10".split(),
        *["--caches", "dynamic,int2:scale_dtype=none,int2"],
    ],
    # The same at 2,048 tokens.
    "eval-ruler-scales-2k": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 2048 --ruler-samples 10".split(),
        *["--caches", "dynamic,int2:scale_dtype=none,int2"],
    ],
    # The int8 residual against the full-precision one on RULER's suite at 1,024 tokens (eval-ruler-scales' samples).
    "eval-ruler-residual": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 10".split(),
        *["--caches", "dynamic,int2:residual_bits=none,int2:residual_bits=8"],
    ],
    # The calibrated widths at 2.25 key bits with the current defaults (8-bit scales), alone and with an int8
    # residual: the combination `plan` puts under both of issue 36's int2 bytes targets (re-measured: eval-keywidths
    # and eval-ruler-keywidths ran with 16-bit scales). Reads results/calibrate-int2-2.25 (RUNS order).
    "eval-keywidths-residual": [
        "eval",
        *REAL,
        *"--max-tokens 2048 --context 1024 --prefill 512 --lengths 512,1024,2048 --depths 0.25,0.75".split(),
        *["--caches", f"dynamic,int2,{KEYWIDTHS_225},{KEYWIDTHS_225}:residual_bits=8"],
    ],
    # The widths searched on random tokens beside the text's, on the same documents (two runs joined).
    "report-keywidths-random": [
        "report",
        *["docs/results/eval-keywidths-residual.json", "docs/results/eval-keywidths-random.json"],
        "--caches",
        f"dynamic,int2,{KEYWIDTHS_225}:residual_bits=8,"
        f"int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2-random')}:residual_bits=8",
    ],
    "eval-ruler-keywidths-residual": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 10".split(),
        *["--caches", f"dynamic,int2,{KEYWIDTHS_225},{KEYWIDTHS_225}:residual_bits=8"],
    ],
    # RULER at 1,024 tokens with the widths searched on random tokens, on eval-ruler-keywidths-residual's documents,
    # then the two runs joined: int2, the text's widths and these side by side.
    "eval-ruler-keywidths-random": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024 --ruler-samples 10".split(),
        *["--caches", f"dynamic,int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2-random')}:residual_bits=8"],
    ],
    "report-ruler-keywidths-random": [
        "report",
        *["docs/results/eval-ruler-keywidths-residual.json", "docs/results/eval-ruler-keywidths-random.json"],
        "--caches",
        f"dynamic,int2,{KEYWIDTHS_225}:residual_bits=8,"
        f"int2:key_bits={KEY_WIDTHS_FILE.format('calibrate-int2-random')}:residual_bits=8",
    ],
    # The same at 2,048 tokens, without plain int2 (eval-ruler-scales-2k's int2 row: the same documents).
    "eval-ruler-keywidths-residual-2k": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 2048 --ruler-samples 10".split(),
        *["--caches", f"dynamic,{KEYWIDTHS_225},{KEYWIDTHS_225}:residual_bits=8"],
    ],
    # At 4,096 tokens on eval-ruler-4k's documents (5 a cell), int2 again: that run predates its 8-bit scales.
    "eval-ruler-keywidths-residual-4k": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 4096 --ruler-samples 5".split(),
        *["--caches", f"dynamic,int2,{KEYWIDTHS_225}:residual_bits=8"],
    ],
    # More documents for the same pair (DynamicCache, the widths with an int8 residual): the commands above at seeds
    # they never read (with --seed S and N documents a cell, a run reads each cell's documents S to S+N-1), then
    # every run of the pair pooled into one table by `hf-kvcache report` (RUNS order: the runs first).
    **{
        f"eval-ruler-keywidths-residual{suffix}-seed{seed}": [
            "eval",
            *REAL,
            *f"--task ruler --chat-template --ruler-lengths {length} --ruler-samples {samples} --seed {seed}".split(),
            *["--caches", f"dynamic,{KEYWIDTHS_225}:residual_bits=8"],
        ]
        for suffix, length, samples, seed in KEYWIDTHS_SEEDS
    },
    # key_bits="auto" (the random-token search, run by the cache itself once per model) alone on the calibrated
    # widths' seed-0 documents at 1k, 2k and 4k, then joined with those runs at each length and pooled over the three
    # by report-ruler-auto. At 1k its widths are calibrate-int2-random's, so it scores as that run's cache does.
    **{
        f"eval-ruler-auto{suffix}": [
            "eval",
            *REAL,
            *f"--task ruler --chat-template --ruler-lengths {length} --ruler-samples {samples}".split(),
            *["--caches", AUTO_INT2],
        ]
        for suffix, length, samples in (("", 1024, 10), ("-2k", 2048, 10), ("-4k", 4096, 5))
    },
    # The same cache on every further document the calibrated widths read (KEYWIDTHS_SEEDS), fixed before these runs
    # so that both caches are pooled over the same 560 documents, whatever they score (report-ruler-auto-pooled).
    **{
        f"eval-ruler-auto{suffix}-seed{seed}": [
            "eval",
            *REAL,
            *f"--task ruler --chat-template --ruler-lengths {length} --ruler-samples {samples} --seed {seed}".split(),
            *["--caches", AUTO_INT2],
        ]
        for suffix, length, samples, seed in KEYWIDTHS_SEEDS
    },
    "report-ruler-auto": [
        "report",
        *(
            f"docs/results/{name}{suffix}.json"
            for suffix in ("", "-2k", "-4k")
            for name in ("eval-ruler-keywidths-residual", "eval-ruler-auto")
        ),
        *["--caches", f"dynamic,{AUTO_INT2}"],
    ],
    # Every run of the two caches and DynamicCache's on the same 560 documents: KEYWIDTHS_POOLED's runs, each joined
    # with the auto cache's run of its documents, pooled.
    "report-ruler-auto-pooled": [
        "report",
        *(f"docs/results/{name}.json" for name in KEYWIDTHS_POOLED),
        *(f"docs/results/{name.replace('keywidths-residual', 'auto')}.json" for name in KEYWIDTHS_POOLED),
        *["--caches", f"dynamic,{KEYWIDTHS_225}:residual_bits=8,{AUTO_INT2}"],
    ],
    # The same documents, the auto cache paired with the text's widths (vs first: auto against them).
    "report-ruler-auto-vs-text": [
        "report",
        *(f"docs/results/{name}.json" for name in KEYWIDTHS_POOLED),
        *(f"docs/results/{name.replace('keywidths-residual', 'auto')}.json" for name in KEYWIDTHS_POOLED),
        *["--caches", f"{KEYWIDTHS_225}:residual_bits=8,{AUTO_INT2}"],
    ],
    "report-ruler-keywidths-residual": [
        "report",
        *(f"docs/results/{name}.json" for name in KEYWIDTHS_POOLED),
        *["--caches", f"dynamic,{KEYWIDTHS_225}:residual_bits=8"],
    ],
    "eval-ruler-smooth": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024,2048 --ruler-samples 10".split(),
        *["--caches", "dynamic,int2,int2:smooth=1,int3,int3:smooth=1"],
    ],
    "eval-ablation": [
        "eval",
        *REAL,
        *"--task perplexity --max-tokens 2048 --context 1024 --prefill 512".split(),
        *["--caches", "dynamic," + ABLATION_CACHES],
    ],
    "eval-lowbit-passkey": [
        "eval",
        *REAL,
        *"--task passkey --lengths 1024,2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2".split(),
        *["--caches", "dynamic,int4,int3,int2,int2:rotate=none:sinks=0:pre_rope=false," + _ROT_SINKS],
    ],
    # RULER's retrieval and tracing tasks through the default caches (the instruct model in its chat template).
    "eval-ruler": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024,2048 --ruler-samples 10".split(),
        *RULER_SIX,
        *["--caches", EVAL_CACHES],
    ],
    # RULER through int2 with 3-bit keys, next to int2 and int3 (keys and values at their own widths).
    "eval-ruler-kvbits": [
        "eval",
        *REAL,
        *"--task ruler --chat-template --ruler-lengths 1024,2048 --ruler-samples 10".split(),
        *RULER_SIX,
        *["--caches", "dynamic,int2,int2:key_bits=3,int3"],
    ],
    # CPU speed and memory on the real model (2 cores, one thread each; 1 repeat: read ratios, not spreads).
    "bench-cpu": ["bench", *REAL, *BENCH, "--contexts", "1024,4096", "--attn", "sdpa,hf_kvcache"],
    "bench-cpu-8k": ["bench", *REAL, *BENCH, "--contexts", "8000"],
    "bench-cpu-batch4": ["bench", *REAL, *BENCH, "--contexts", "4096", "--batch", "4"],
    "bench-cpu-budget": [
        "bench",
        *REAL,
        *"--new-tokens 4 --repeats 1 --contexts 1024 --caches dynamic,int8,int4,int2 --memory-budget-gib 0.75".split(),
    ],
    "eval-stream": [
        "eval",
        *REAL,
        *"--task stream --stream-tokens 16384 --bucket 1024 --stream-chunk 16".split(),
        "--caches",
        STREAM_CACHES,
    ],
    # Not the CLI: benchmarks/bench_cpu.py (hf_kvcache.tools.bench_cpu), decode paths and 16-token chunks on CPU.
    # int4's rotated layout (its default) against KIVI's, side by side in one run (eval-int4-rotated's quality).
    "bench-cpu-int4": [
        "bench",
        *REAL,
        *"--new-tokens 8 --repeats 3 --contexts 1024,4096 --attn sdpa,hf_kvcache".split(),
        *["--caches", "dynamic,int4:rotate=none:sinks=0,int4:rotate=hadamard:sinks=4:scale_dtype=e5m3"],
    ],
    "bench-cpu-paths": ["bench-cpu", "--model", "smollm2", "--threads", "1", "--rounds", "3"],
}
TOOLS = {"bench-cpu": "python benchmarks/bench_cpu.py"}  # RUNS whose first word names a tool, not a CLI command


def command_of(name: str) -> str:
    """The command line a saved run came from."""
    argv = RUNS[name]
    if argv[0] in TOOLS:
        return f"{TOOLS[argv[0]]} {shlex.join(argv[1:])}"
    return "hf-kvcache " + shlex.join(argv)


def load_run(name: str) -> dict:
    path = SAVED / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no saved run {name!r} ({path}); run: python scripts/build_results.py --run {name}")
    return json.loads(path.read_text())


def render(name: str) -> str:
    record = load_run(name)
    if record["kind"] == "gpu-run":  # saved by `python -m hf_kvcache.tools.gpu_run.render RUN_DIR --save NAME`
        from .gpu_run.render import render as render_gpu_run

        return render_gpu_run(record)
    if record["kind"] == "calibrate":
        from hf_kvcache.eval.calibration import format_widths
        from hf_kvcache.layer_widths import LayerKeyWidths

        return "\n".join(
            ["```bash", record["command"], "```", "", format_widths(LayerKeyWidths.from_dict(record["results"]))]
        )
    if record["kind"] == "bench-cpu":
        from .bench_cpu import render as render_bench_cpu

        return "\n".join(["```bash", record["command"], "```", "", render_bench_cpu(record["results"])])
    from hf_kvcache.eval.report import render_saved_run

    return render_saved_run(record)


def regions(text: str):
    """``(name, body)`` of every results region in a page."""
    return [(m["name"], m["body"]) for m in REGION.finditer(text)]


def stale_regions(text: str) -> list[str]:
    """Names of the regions whose body is not the rendering of their saved run."""
    return [name for name, body in regions(text) if body.strip() != render(name).strip()]


def rewrite(text: str) -> str:
    return REGION.sub(lambda m: m.group(1) + render(m["name"]) + "\n" + m.group(4), text)


def run(name: str) -> None:
    from hf_kvcache.cli import main as cli

    argv = RUNS[name]
    out = ROOT / "results" / name
    print(f"== {name}: {command_of(name)}", flush=True)
    kind = argv[0]
    if kind == "bench-cpu":
        from .bench_cpu import main as bench_cpu

        if bench_cpu([*argv[1:], "--output", str(out)]) != 0:
            raise SystemExit(f"{name} failed")
        results = json.loads((out / "bench-cpu.json").read_text())
    elif kind == "calibrate":
        if cli([*argv, "--output", KEY_WIDTHS_FILE.format(name)]) != 0:
            raise SystemExit(f"{name} failed")
        results = json.loads((ROOT / KEY_WIDTHS_FILE.format(name)).read_text())
    else:  # eval, bench, and report (of saved runs: its results.json is their pooled or joined run)
        if cli([*argv, "--output", str(out)]) != 0:
            raise SystemExit(f"{name} failed")
        results = json.loads((out / ("bench.json" if kind == "bench" else "results.json")).read_text())
    SAVED.mkdir(exist_ok=True)
    record = {"command": command_of(name), "kind": kind, "results": results}
    (SAVED / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


def write_pages() -> list[Path]:
    changed = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="*", metavar="NAME", help=f"runs to (re)produce: {', '.join(RUNS)} (all)")
    parser.add_argument("--write", action="store_true", help="re-render the results regions of docs/*.md")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # runs name files under results/ relative to the checkout (the published commands show them so)
    if args.run is None and not args.write:
        parser.error("nothing to do: give --run [NAME ...] and/or --write")
    if args.run is not None:
        unknown = [n for n in args.run if n not in RUNS]
        if unknown:
            parser.error(f"--run: unknown run(s) {unknown}; known: {', '.join(RUNS)}")
        for name in args.run or RUNS:
            run(name)
    for page in write_pages():
        print(f"updated {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
