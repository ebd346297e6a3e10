"""One rank of the tensor-parallel test (tests/test_tensor_parallel.py), run under ``torchrun --nproc_per_node 2``.

Loads the tiny model saved in ``argv[1]`` with ``tp_plan="auto"`` (each rank holds a shard of every layer's heads),
generates a left-padded batch with ``DynamicCache`` and with each cache spec, and on rank 0 writes to ``argv[2]`` a JSON
object: per spec, whether the sequences and logits equal DynamicCache's, the KV heads each rank's layers hold, and the
bytes the cache stores next to what ``kv_bytes(..., tp=2)`` plans.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvcache import cache_nbytes, make_cache
from hf_kvcache.plan import kv_bytes

SPECS = ("int8", "int4:residual_length=2", "sink:window=256:sinks=4", "paged:block_size=4", "paged:bits=8")
NEW = 6


def main(folder: str, out: str) -> None:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0

    def run(cache):
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )

    ref_cache = DynamicCache(config=model.config)
    ref = run(ref_cache)
    report = {
        "tp_size": model.tp_size,
        "world_size": dist.get_world_size(),
        "dynamic_heads": ref_cache.layers[0].keys.shape[1],
        "config_kv_heads": model.config.num_key_value_heads,
        "dynamic_bytes": cache_nbytes(ref_cache),
        "dynamic_planned": kv_bytes("dynamic", model.config, 9 + NEW - 1, batch=2, dtype=torch.float32, tp=2),
        "caches": {},
    }
    for spec in SPECS:
        cache = make_cache(spec, model)
        out_ = run(cache)
        same_tokens = torch.equal(out_.sequences, ref.sequences)
        error = max((a - b).abs().max().item() for a, b in zip(out_.logits, ref.logits))
        # Teacher-forced bound of the lossy caches, as in tests/test_families.py: error / the logits' std per step.
        relative = max(((a - b).abs().amax(-1) / b.std(-1)).max().item() for a, b in zip(out_.logits, ref.logits))
        report["caches"][spec] = {
            "same_tokens": same_tokens,
            "max_logit_error": error,
            "relative_error": relative,
            "layer_heads": cache.layer_specs[0].num_kv_heads,
            "bytes": cache_nbytes(cache),
            "planned": kv_bytes(spec, model.config, 9 + NEW - 1, batch=2, dtype=torch.float32, prompt=9, tp=2),
        }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
