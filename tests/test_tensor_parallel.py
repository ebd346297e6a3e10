"""Tensor parallelism: a tiny Llama loaded with ``tp_plan="auto"`` on 2 CPU processes (gloo), each rank holding half
of every layer's KV heads. Every cache serves it, sized from the rank's share of the heads; the lossless ones equal
DynamicCache under the same sharding, int8 and int4 stay within their bounds, and the plan's bytes per rank equal what
each cache stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
LOSSLESS = ("sink:window=256:sinks=4", "paged:block_size=4")
BOOKKEEPING = 64  # bytes per layer the plan may differ by (counters, partial groups; see test_plan.py)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    out = folder / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / "tp_worker.py"), str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_each_rank_holds_half_the_heads(report):
    assert report["tp_size"] == report["world_size"] == 2
    assert report["dynamic_heads"] == report["config_kv_heads"] // 2 == 1
    assert abs(report["dynamic_bytes"] - report["dynamic_planned"]) == 0
    for spec, row in report["caches"].items():
        assert row["layer_heads"] == 1, spec


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_caches_equal_dynamic_cache_under_the_same_sharding(report, spec):
    row = report["caches"][spec]
    assert row["same_tokens"] and row["max_logit_error"] <= 1e-5, row


def test_quantized_caches_run_sharded_within_their_bounds(report):
    # The bounds of tests/test_families.py (x the logits' std), on tokens that agree with DynamicCache's.
    for spec, bound in (("int8", 0.06), ("paged:bits=8", 0.06), ("int4:residual_length=2", 0.35)):
        row = report["caches"][spec]
        assert row["same_tokens"] and row["relative_error"] <= bound, (spec, row)


def test_plan_per_rank_equals_stored_bytes(report):
    for spec, row in report["caches"].items():
        assert abs(row["planned"] - row["bytes"]) <= BOOKKEEPING * 2, (spec, row)
