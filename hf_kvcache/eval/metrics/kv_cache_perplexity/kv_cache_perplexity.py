"""An ``evaluate`` metric: perplexity of texts scored *through* a KV cache.

Load it by path, no hub needed::

    import evaluate
    from hf_kvcache.eval import metric_path

    metric = evaluate.load(metric_path())
    metric.compute(predictions=["Some text.", "More text."], model_id="path/or/id", cache="int4")

Each text is tokenized on its own and scored with the harness's window protocol (``context``, ``prefill``,
``chunk``), through caches from ``hf_kvcache.make_cache(cache, model)``.
"""

import datasets
import evaluate
import torch

from hf_kvcache.eval.config import EvalConfig
from hf_kvcache.eval.runner import load_configured_model, tokenize
from hf_kvcache.eval.tasks.perplexity import window_perplexity
from hf_kvcache.registry import make_cache

_DESCRIPTION = __doc__
_KWARGS = """
Args:
    predictions: texts to score.
    model_id: hub id or local path of a causal LM (default: the embedded reference model).
    cache: a make_cache spec (default "dynamic").
    context, prefill, chunk: the window protocol (defaults 512, 256, 1); a text shorter than prefill + 1 tokens is
        scored with prefill = 1.
    device, dtype: as in hf-kvcache eval (defaults "auto", "float32").
Returns:
    perplexities: one per text; mean_perplexity: their mean; perplexity: exp of the total NLL over all scored tokens;
    tokens_scored: the total.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class KVCachePerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://arxiv.org/abs/2402.02750", "https://arxiv.org/abs/2309.17453"],
        )

    def _compute(
        self,
        predictions,
        model_id=None,
        cache="dynamic",
        context=512,
        prefill=256,
        chunk=1,
        device="auto",
        dtype="float32",
    ):
        config = EvalConfig(
            model=model_id, device=device, dtype=dtype, task=("perplexity",), caches=(cache,), context=context,
            prefill=prefill, chunk=chunk, quiet=True,
        )  # fmt: skip
        config.validate()
        model, tokenizer = load_configured_model(config)
        perplexities, total_nll, total_tokens = [], 0.0, 0
        for text in predictions:
            ids = tokenize(tokenizer, text)
            if ids.numel() < 2:
                raise ValueError(f"a text must have at least 2 tokens to score, got {ids.numel()}: {text!r}")
            first = prefill if ids.numel() > prefill else 1
            with torch.inference_mode():
                result = window_perplexity(
                    model, ids, lambda: make_cache(cache, model), context=context, prefill=first, chunk=chunk
                )
            perplexities.append(result.perplexity)
            total_nll += result.nll
            total_tokens += result.tokens_scored
        return {
            "perplexities": perplexities,
            "mean_perplexity": sum(perplexities) / len(perplexities),
            "perplexity": float(torch.tensor(total_nll / total_tokens).exp()),
            "tokens_scored": total_tokens,
        }
