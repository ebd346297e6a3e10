"""lm-evaluation-harness through the cache: the ``hf-kvcache`` model for ``lm_eval``.

lm-eval's ``hf`` model scores a loglikelihood request with one forward over context + continuation, which never
reads a cache: a quantized or evicting cache plugged into it would show no effect at all. :class:`HFKVCacheLM`
subclasses that model (every usual ``model_args`` works: ``pretrained``, ``dtype``, ``device``, ``batch_size``,
``device_map`` / ``parallelize``, ``load_in_8bit`` / ``load_in_4bit``, ...) and adds two:

* ``cache``: a :func:`hf_kvcache.make_cache` spec (default ``dynamic``), e.g. ``cache=int4:group_size=32``;
* ``chunk``: continuation tokens per forward when scoring (default 1: decoding's logits, in as many tokens per
  forward as the cache gives them exactly, :mod:`hf_kvcache.scoring`; ``stepwise=True``: one token per forward).

``loglikelihood`` and ``loglikelihood_rolling`` are scored *through* the cache, the protocol of the harness's
``perplexity`` task: per batch of requests, the contexts (left-padded) go into a fresh cache with one forward
(``prefill_chunk`` tokens at a time when long), then the continuations go through that cache, each token scored from
the logits of the position before it. ``generate_until`` passes a fresh cache of the spec
to every ``generate()`` call. With ``cache=dynamic`` the scores equal lm-eval's ``hf`` model's to float rounding
(``tests/test_lmeval.py``).

Use it from lm-eval's CLI with ``python -m hf_kvcache.lmeval`` (lm-eval's own arguments; it registers the model,
then runs lm-eval's CLI), or from Python after ``import hf_kvcache.lmeval``::

    python -m hf_kvcache.lmeval --model hf-kvcache --model_args pretrained=PATH,cache=int4 --tasks lambada_openai

    import hf_kvcache.lmeval, lm_eval
    lm_eval.simple_evaluate(model="hf-kvcache", model_args="pretrained=PATH,cache=int8", tasks=["hellaswag"])

lm-eval releases that discover out-of-tree model backends through package entry points (lm-evaluation-harness PR
4013) find ``hf-kvcache`` through the ``lm_eval.models`` entry point this package declares, so plain ``lm_eval
--model hf-kvcache`` works there too. Needs the ``lmeval`` extra (``pip install "hf-kvcache[lmeval]"``).
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ._compat import with_cache
from ._validate import check_bool, check_int
from .prefill import left_padded
from .registry import check_spec, make_cache
from .scoring import decode_equivalent_tokens, tokens_per_forward

__all__ = ["HFKVCacheLM", "MODEL_NAME", "main", "write_passkey_task"]

MODEL_NAME = "hf-kvcache"


@register_model(MODEL_NAME)
class HFKVCacheLM(HFLM):
    """lm-eval's Hugging Face causal LM, with every request scored or generated through a cache of ``cache``."""

    def __init__(
        self,
        *args,
        cache: str = "dynamic",
        chunk: int = 1,
        prefill_chunk: int = 4096,
        stepwise: bool = False,
        **kwargs,
    ):
        check_spec(str(cache))  # a bad spec fails before the model loads
        check_int("chunk", chunk, 1)
        check_int("prefill_chunk", prefill_chunk, 1)
        check_bool("stepwise", stepwise)
        super().__init__(*args, **kwargs)
        if self.backend != "causal":
            raise ValueError(
                f"{MODEL_NAME} scores causal LMs through a KV cache; this model's backend is {self.backend}"
            )
        self.cache_spec, self.chunk, self.prefill_chunk = str(cache), chunk, prefill_chunk
        self.per_forward = tokens_per_forward(chunk, stepwise)  # None: what the cache allows
        make_cache(self.cache_spec, self.model)  # option values checked against the model's config now

    def _fresh_cache(self):
        return make_cache(self.cache_spec, self.model)

    # -- loglikelihood through the cache ------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        from tqdm import tqdm

        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 1)
        # Longest first (any OOM happens at once), as lm-eval's hf model orders them.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="loglikelihood through the cache")
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            scores = self._score_batch([(requests[i][1], requests[i][2]) for i in batch])
            for i, answer in zip(batch, scores):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(batch))
        bar.close()
        return results

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, every continuation token greedy) per (context, continuation) pair."""
        prefixes, continuations = [], []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("a loglikelihood request needs at least one continuation token")
            whole = (context + continuation)[-(self.max_length + 1) :]  # lm-eval's hf truncation
            cut = len(whole) - len(continuation)
            if cut < 1:
                raise ValueError(
                    f"continuation of {len(continuation)} tokens leaves no context within max_length={self.max_length}"
                )
            prefixes.append(whole[:cut])
            continuations.append(continuation)
        rows, device = len(pairs), self.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = left_padded(prefixes, pad)
        width = ids.shape[1]
        ids, mask = ids.to(device), mask.to(device)
        cache = self._fresh_cache()
        logits = None
        for a in range(0, width, self.prefill_chunk):  # the contexts, into a fresh cache
            b = min(width, a + self.prefill_chunk)
            logits = self._forward(ids[:, a:b], mask[:, :b], cache)
        last = logits[:, -1:]  # predicts each continuation's first token
        steps = max(len(c) for c in continuations)
        targets = torch.full((rows, steps), pad, dtype=torch.long)
        valid = torch.zeros((rows, steps), dtype=torch.bool)
        for r, c in enumerate(continuations):
            targets[r, : len(c)] = torch.tensor(c)
            valid[r, : len(c)] = True
        targets, valid = targets.to(device), valid.to(device)
        predicted = [last]
        done = 0
        while done < steps - 1:  # the continuations, through the cache
            left = steps - 1 - done
            n = min(self.per_forward, left) if self.per_forward else decode_equivalent_tokens(cache, left)
            mask = torch.cat([mask, torch.ones((rows, n), dtype=mask.dtype, device=device)], dim=1)
            predicted.append(self._forward(targets[:, done : done + n], mask, cache))
            done += n
        logprobs = torch.cat(predicted, dim=1).float().log_softmax(-1)  # (rows, steps, vocab)
        picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        greedy = (logprobs.argmax(-1) == targets) | ~valid
        totals = torch.where(valid, picked, 0.0).sum(-1)
        return [(float(totals[r]), bool(greedy[r].all())) for r in range(rows)]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(self.model, cache), use_cache=True
        )
        return out.logits

    # -- generation through the cache ---------------------------------------------------------------------------

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        generation_kwargs.update(with_cache(self.model, self._fresh_cache()))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


# -- a local task ------------------------------------------------------------------------------------------------

TASK_YAML = """\
# Written by hf_kvcache.lmeval.write_passkey_task: passkey retrieval as a {choices}-way multiple choice.
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_passkey_task(
    directory,
    name: str = "kv_passkey",
    lengths: tuple[int, ...] = (512, 1024, 1900),
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75),
    samples: int = 3,
    choices: int = 4,
    seed: int = 0,
) -> str:
    """Write an lm-eval task (``NAME.yaml`` + ``NAME.jsonl``) to ``directory``: passkey documents over the held-out
    text (the harness's passkey format, :mod:`hf_kvcache.eval.tasks.passkey`), each followed by ``choices`` 5-digit
    keys, one of them the key stated in the document. Scored by loglikelihood: a cache that lost or blurred the key
    picks a wrong one. Returns the task name, for ``--tasks NAME --include_path DIRECTORY``."""
    import json
    import random
    from pathlib import Path

    from transformers import AutoTokenizer

    from .eval.tasks.passkey import build_passkey_document
    from .reference import reference_model_path, reference_text

    check_int("samples", samples, 1)
    check_int("choices", choices, 2)
    if not name.isidentifier():
        raise ValueError(f"name must be a plain identifier (letters, digits, _), got {name!r}")
    tokenizer = AutoTokenizer.from_pretrained(reference_model_path())
    stream = torch.tensor(tokenizer(reference_text(), add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        for depth in depths:
            for _ in range(samples):
                keys = set()
                while len(keys) < choices:
                    keys.add("".join(rng.choice("0123456789") for _ in range(5)))
                keys = sorted(keys)
                answer = rng.randrange(choices)
                start = rng.randrange(0, stream.numel() - length)
                doc = build_passkey_document(tokenizer, stream[start:], length, depth, keys[answer])
                text = tokenizer.decode(doc.context + doc.question, skip_special_tokens=True)
                rows.append({"context": text, "choices": keys, "answer": answer, "length": length, "depth": depth})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    data = (out / f"{name}.jsonl").resolve()
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=json.dumps(str(data)), choices=choices))
    return name


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``hf-kvcache`` model registered (``python -m hf_kvcache.lmeval ...``);
    ``python -m hf_kvcache.lmeval write-task DIR`` writes the local passkey task instead."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["write-task"]:
        if len(argv) != 2:
            print("usage: python -m hf_kvcache.lmeval write-task DIRECTORY", file=sys.stderr)
            return 2
        name = write_passkey_task(argv[1])
        print(f"wrote {argv[1]}/{name}.yaml; run it with --tasks {name} --include_path {argv[1]}")
        return 0
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
