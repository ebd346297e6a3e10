"""Our caches on a model split across devices with accelerate's ``device_map``.

Large models are loaded in pieces: ``from_pretrained(..., device_map=...)`` puts each decoder layer on a device of
its own, and accelerate moves activations between them. A cache then holds each layer's keys and values on that
layer's device. This script splits the reference model's 4 decoder layers over what the machine has:

* two or more GPUs: consecutive layers share a GPU (2 GPUs: layers 0-1 on the first, 2-3 on the second);
* one GPU: layers 0-1 on the GPU, layers 2-3 and the final norm on the CPU;
* no GPU: layers 0-1 in CPU memory, layers 2-3 offloaded to disk (a temporary ``offload_folder``; accelerate loads
  their weights to the CPU for each forward).

It then generates greedily with ``QuantizedKVCache`` and ``PagedKVCache`` on the split model and checks that the
tokens equal the same generate() on the model loaded whole on the CPU. Layers on the CPU or offloaded to disk run
the same CPU arithmetic as the whole model, so there the tokens must be equal and the script fails otherwise; GPU
kernels round differently in the last bits, which can flip a greedy near-tie, so with GPUs a difference is reported
but is not by itself an error.

Run it with::

    python examples/device_map_split.py
    python examples/device_map_split.py --new-tokens 200

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM

from hf_kvcache import PagedKVCache, QuantizedKVCache, load_reference_model, reference_model_path

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
PROMPT = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who"


def split_device_map() -> dict[str, str | int]:
    """Module name -> device for the reference model's layout (``model.layers.0`` .. ``model.layers.3``)."""
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        layers = [i * gpus // 4 for i in range(4)]
        first, last = 0, layers[-1]
    elif gpus == 1:
        layers, first, last = [0, 0, "cpu", "cpu"], 0, "cpu"
    else:
        layers, first, last = ["cpu", "cpu", "disk", "disk"], "cpu", "cpu"
    device_map: dict[str, str | int] = {"model.embed_tokens": first, "model.rotary_emb": first}
    device_map |= {f"model.layers.{i}": device for i, device in enumerate(layers)}
    # The head shares its weight with the embedding (tied), so they must live on the same device.
    device_map |= {"model.norm": last, "lm_head": first}
    return device_map


def greedy(model, inputs, cache, new_tokens: int) -> torch.Tensor:
    """The new tokens of one greedy generate() through ``cache``, on the CPU."""
    with torch.inference_mode():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=24 if SMALL else 100)
    args = parser.parse_args()

    whole, tokenizer = load_reference_model()  # on the CPU, in one piece
    with tempfile.TemporaryDirectory() as offload_folder:
        split = AutoModelForCausalLM.from_pretrained(
            reference_model_path(), dtype=torch.float32, device_map=split_device_map(), offload_folder=offload_folder
        ).eval()
        print("device map of the split model:")
        for module, device in split.hf_device_map.items():
            print(f"  {module:<20} {device}")
        print()

        all_equal = True
        for make in (QuantizedKVCache, PagedKVCache):
            inputs = tokenizer(PROMPT, return_tensors="pt")
            expected = greedy(whole, inputs, make(whole), args.new_tokens)
            # The inputs go to the first module's device; accelerate's hooks move activations on from there.
            cache = make(split)
            tokens = greedy(split, inputs.to(split.device), cache, args.new_tokens)
            equal = torch.equal(tokens, expected)
            all_equal &= equal
            print(f"{make.__name__}: split-model tokens equal whole-model tokens: {equal} ({cache.nbytes:,} bytes)")
            print(f"  {tokenizer.decode(tokens, skip_special_tokens=True)!r}")

    print(f"\nall tokens equal: {all_equal}")
    if not all_equal and torch.cuda.device_count() == 0:
        raise SystemExit("the split model generated other tokens than the whole model on the same CPU arithmetic")


if __name__ == "__main__":
    main()
