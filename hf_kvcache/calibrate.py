"""Per-layer key widths from a calibration run (KVTuner's idea, https://arxiv.org/abs/2502.04420): measure what each
layer's keys cost at fewer bits, then give the bits to the layers where they buy the most, under a budget.

At 2 bits the keys carry most of the loss (docs/results.md, "Keys and values at their own widths"), but not every
layer's keys equally: a layer whose heads retrieve (copy, look a fact up) needs its keys to rank the right token
first, a layer that attends broadly does not. :func:`search_key_bits` measures it on the user's model:

1. the calibration rows' context is prefilled once (:class:`~hf_kvcache.prefill.SharedPrefill`) and handed to a
   ``QuantizedKVCache`` per configuration; the rows' last ``scored_tokens`` are fed through it in one forward, which
   reads the context's keys and values as stored (decode reads them the same way), and their next-token
   distributions are compared with a full-precision cache's (mean KL divergence, nats per token);
2. the baseline: every layer's keys at the widest width searched; then each layer alone at each narrower width;
3. the widths: the assignment with the least summed loss (each layer's measured loss above the baseline, taken as
   additive) whose key bits stay within ``budget`` bits per key element on average, found exactly by dynamic
   programming over the layers (:meth:`~hf_kvcache.layer_widths.LayerKeyWidths.with_budget`, which re-chooses for
   another budget from a saved record without running the model again).

:func:`copy_rows` builds rows whose scored tail repeats their beginning, so the measurement is of copying from far
back, where low-bit keys show their cost (perplexity on running text hides it). :func:`random_copy_rows` builds the
same rows from uniformly random token ids: a search that needs no text and no tokenizer, only the model (a model
copies a random sequence through the same heads as a text; on SmolLM2 the two searches chose nearly the same widths,
docs/results.md "Calibrated without a text").

:func:`auto_key_bits` is that search with fixed rows and budget, run once per model and cache options and kept on
disk: what ``QuantizedKVCache(model, bits=2, key_bits="auto")`` (spec ``int2:key_bits=auto``) reads.

The caches measured are built through the registry (``int2``, ``int3``, ``int4``: :class:`QuantizedKVCache`'s
kinds), so ``QuantizedKVCache`` can resolve ``key_bits="auto"`` here without this module importing it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ._compat import with_cache
from ._config import decoder_layer, decoder_layers, recurrent_loops, resolve_config
from ._validate import check_choice, check_int
from .layer_widths import KEY_WIDTHS, LayerKeyWidths, check_budget
from .models import model_cache_dir
from .prefill import SharedPrefill, every_token_cache
from .registry import make_cache

__all__ = [
    "AUTO_SEARCH",
    "auto_key_bits",
    "auto_search_rows",
    "copy_rows",
    "random_copy_rows",
    "search_key_bits",
]

logger = logging.getLogger(__name__)

# What key_bits="auto" searches on: calibrate --random-tokens' defaults (4 rows of 1,024 random token ids, their first
# 128 scored again), under a budget of a quarter bit above the values' width. On SmolLM2 at 2 bits with an int8
# residual these are the rows and budget of docs/results/calibrate-int2-random.json, whose widths measured +0.36%
# perplexity, +11.7% second copies and RULER 1k 50.4 against DynamicCache's 51.2 (int2: +0.78%, +36.3%, 34.0).
AUTO_SEARCH = {"rows": 4, "tokens": 1024, "scored_tokens": 128, "extra_bits": 0.25, "seed": 0}
_FORMAT = "hf_kvcache.auto_key_bits/1"  # part of every fingerprint: a change of the search's recipe bumps it
_FOUND: dict[str, LayerKeyWidths] = {}  # fingerprint -> widths, so a process reads each file once


def copy_rows(ids: torch.Tensor, rows: int, tokens: int, scored_tokens: int) -> torch.Tensor:
    """``(rows, tokens)`` calibration rows cut one after another from the 1-D token ids ``ids``: each row is
    ``tokens - scored_tokens`` tokens of text followed by its own first ``scored_tokens`` tokens again, so the scored
    tail can only be predicted well by copying from the row's beginning."""
    check_int("rows", rows, 1)
    check_int("scored_tokens", scored_tokens, 1)
    check_int("tokens", tokens, 2 * scored_tokens)
    context = tokens - scored_tokens
    if ids.ndim != 1 or ids.numel() < rows * context:
        raise ValueError(f"copy_rows: {rows} rows of {context} tokens of text need {rows * context} tokens of ids")
    body = ids[: rows * context].view(rows, context)
    return torch.cat([body, body[:, :scored_tokens]], dim=1)


def random_copy_rows(vocab_size: int, rows: int, tokens: int, scored_tokens: int, seed: int = 0) -> torch.Tensor:
    """:func:`copy_rows` of uniformly random token ids in ``[0, vocab_size)`` (``seed`` chooses them): the copy
    without a text, so a model's widths can be searched from the model alone."""
    check_int("vocab_size", vocab_size, 1)
    check_int("tokens", tokens, 2 * check_int("scored_tokens", scored_tokens, 1))
    count = check_int("rows", rows, 1) * (tokens - scored_tokens)
    ids = torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(seed))
    return copy_rows(ids, rows, tokens, scored_tokens)


@torch.inference_mode()
def search_key_bits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    bits: int = 2,
    budget: float = 2.5,
    scored_tokens: int = 128,
    widths: Sequence[int] = KEY_WIDTHS,
    progress: Callable[[int], None] | None = None,
    replay: bool = True,
    **cache_options: object,
) -> LayerKeyWidths:
    """Each decoder layer's key width, measured on ``model`` (see the module docstring).

    Args:
        model: a causal LM (any family ``QuantizedKVCache`` serves).
        input_ids: ``(rows, tokens)`` calibration rows without padding (e.g. :func:`copy_rows`); their last
            ``scored_tokens`` are scored, the rest is the context they read through the cache.
        bits: the values' width (4, 3 or 2), as ``QuantizedKVCache(bits=...)``.
        budget: average key bits per key element allowed, between the narrowest and widest of ``widths`` (2.5: one
            more bit than 2 on half the layers' keys, or two more on a quarter; beside 2-bit values, 2.25 bits per
            stored number).
        scored_tokens: tokens per row scored.
        widths: the key widths to choose from (a subset of 4, 3, 2).
        progress: called with 1 after each measured configuration (``1 + layers x (len(widths) - 1)`` of them).
        replay: each configuration's forward replays the baseline's outputs of the layers before the one it narrows
            instead of computing them again (:class:`_LayerReplay`; the same measurements to the bit, SmolLM2's
            search in 0.74x of the time); False runs every layer of every configuration.
        cache_options: the other ``QuantizedKVCache`` options (``residual_length``, ``group_size``, ``rotate``, ...)
            the widths are for; measured with them.

    Returns the widths and the measurements (:class:`~hf_kvcache.layer_widths.LayerKeyWidths`; ``.save(path)``
    writes the file ``QuantizedKVCache(key_bits=path)`` reads).
    """
    check_choice("bits", bits, KEY_WIDTHS)
    widths = sorted({check_choice("widths", w, KEY_WIDTHS) for w in widths})
    if not widths:
        raise ValueError("widths must name at least one of 4, 3, 2")
    check_budget(budget, widths)  # before the model runs: with_budget checks it again, after
    _check_chosen_by_search(cache_options, "cache_options")
    check_int("scored_tokens", scored_tokens, 1)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (rows, tokens), got shape {tuple(input_ids.shape)}")
    context = input_ids.shape[1] - scored_tokens
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    probe = make_cache(f"int{bits}", model, **cache_options)
    layers = decoder_layers(probe.layer_specs)  # a loop layer takes its decoder layer's width
    # the cache layers each decoder layer's width applies to (a recurrent-depth model's loop layers store it again),
    # so that the budget counts every key element the cache stores
    served = Counter(decoder_layer(probe.layer_specs, i) for i in range(len(probe.layer_specs)))
    quantized_from = probe.residual_length + probe.sinks
    if context <= quantized_from:
        raise ValueError(
            f"input_ids: {context} tokens of context before the {scored_tokens} scored ones leave nothing quantized "
            f"(the cache keeps its last {probe.residual_length} tokens and first {probe.sinks} in full precision): "
            f"give rows of more than {quantized_from + scored_tokens} tokens"
        )

    prefill = SharedPrefill(model, input_ids[:, :context])
    tail = input_ids[:, context:]

    def log_probs(cache) -> torch.Tensor:
        logits = model(input_ids=tail, **with_cache(model, prefill.into(cache))).logits
        return torch.log_softmax(logits.float(), dim=-1)

    exact = log_probs(every_token_cache(model))

    def loss(key_bits: list[int]) -> float:
        measured = log_probs(make_cache(f"int{bits}", model, key_bits=key_bits, **cache_options))
        kl = (exact.exp() * (exact - measured)).sum(-1).mean().item()
        if progress is not None:
            progress(1)
        return kl

    top = widths[-1]
    replayer = _LayerReplay.of(model, layers) if replay else _LayerReplay(None)
    with replayer.recording():
        baseline = loss([top] * layers)
    sensitivity = []
    for layer in range(layers):
        row = {str(top): baseline}
        for width in widths[:-1]:
            if probe.layer_specs[layer].holds_kv:
                with replayer.replaying(layer):
                    row[str(width)] = loss([top if i != layer else width for i in range(layers)])
            else:  # a recurrent layer of a hybrid model stores no keys: every width is the same cache
                row[str(width)] = baseline
        sensitivity.append(row)
    measured = LayerKeyWidths(
        key_bits=(top,) * layers,
        bits=bits,
        budget=float(budget),
        model_type=getattr(model.config, "model_type", ""),
        calibration_tokens=input_ids.numel(),
        scored_tokens=tail.numel(),
        baseline=baseline,
        sensitivity=tuple(sensitivity),
        key_elements=tuple(
            served[i] * spec.num_kv_heads * spec.key_dim for i, spec in enumerate(probe.layer_specs[:layers])
        ),
    )
    return measured.with_budget(budget)


def auto_key_bits(
    model: torch.nn.Module, bits: int = 2, progress: Callable[[int], None] | None = None, **cache_options: object
) -> LayerKeyWidths:
    """The per-layer key widths ``QuantizedKVCache(model, bits=bits, key_bits="auto", **cache_options)`` uses:
    :func:`search_key_bits` on :func:`random_copy_rows` (``AUTO_SEARCH``: 4 rows of 1,024 tokens, or the model's
    context if shorter) under a budget of ``bits + 0.25`` key bits per element, for the cache of ``cache_options``.

    The search costs ``1 + 2 x layers`` forwards of the rows, most of them through the later layers only
    (SmolLM2-135M: 61 forwards, 256 s on one CPU thread; not yet timed on a GPU), so its record is kept as a widths
    file in ``<cache dir>/key_bits/`` (``$HF_KVCACHE_CACHE``, else ``~/.cache/hf_kvcache``), named by a fingerprint
    of the model's config, dtype and weights (a sample of each parameter) and of the cache's resolved options: the
    same model and cache read it back, another model or a fine-tuned one searches again. The file is an ordinary
    widths file (``key_bits=PATH`` reads it; ``plan`` counts its bytes). ``progress`` is called with 1 after each
    forward of a search that runs (not when the file is read).
    """
    if bits not in (3, 2):
        raise ValueError(
            f"key_bits='auto' chooses keys among 2, 3 and 4 bits a quarter bit above the values' width: bits must be "
            f"3 or 2, got {bits!r} (int4's keys are already the widest)"
        )
    _check_chosen_by_search(cache_options, "key_bits='auto'")
    probe = make_cache(f"int{bits}", model, **cache_options)  # bad options fail here, before any forward
    key = _fingerprint(model, repr(probe), _auto_tokens(model))
    if key in _FOUND:
        return _FOUND[key]
    path = model_cache_dir() / "key_bits" / f"{key}.json"
    try:
        found = LayerKeyWidths.load(path)
    except (ValueError, OSError):  # not searched yet, or a file or folder that cannot be read: search
        logger.warning(  # once per model and cache: minutes on a CPU, where a user should know why it waits
            "key_bits='auto': searching the key widths of %s (%d forwards, once: kept in %s)",
            repr(probe),
            1 + 2 * decoder_layers(probe.layer_specs),
            path,
        )
        found = search_key_bits(
            model, auto_search_rows(model), bits, bits + AUTO_SEARCH["extra_bits"], AUTO_SEARCH["scored_tokens"],
            progress=progress, **cache_options,
        )  # fmt: skip
        found = dataclasses.replace(found, calibration_rows="random tokens")
        _save(found, path)
    _FOUND[key] = found
    return found


def _auto_tokens(model: torch.nn.Module) -> int:
    """Tokens per row of the auto search: ``AUTO_SEARCH``'s, or the model's context where it is shorter."""
    context = getattr(resolve_config(model), "max_position_embeddings", None) or AUTO_SEARCH["tokens"]
    return min(AUTO_SEARCH["tokens"], context)


def auto_search_rows(model: torch.nn.Module, rows: int = AUTO_SEARCH["rows"]) -> torch.Tensor:
    """The random copy rows :func:`auto_key_bits` searches on (``rows`` of them)."""
    vocab = model.get_input_embeddings().num_embeddings
    return random_copy_rows(vocab, rows, _auto_tokens(model), AUTO_SEARCH["scored_tokens"], AUTO_SEARCH["seed"])


class _LayerReplay:
    """The baseline forward's decoder-layer outputs, replayed where a configuration cannot change them.

    A configuration that narrows layer ``l``'s keys alone differs from the baseline (every layer at the widest width)
    from layer ``l`` on: each layer before it reads the same input, weights and stored context as in the baseline's
    forward, so it returns what it returned there instead of computing it again, and the configuration's forward
    costs the layers from ``l`` on (about half the search's layers over all). Layers that are skipped leave their
    cache layers unread and unwritten, which no later layer looks at; a model where one layer reads another's keys and
    values (``num_kv_shared_layers``), a recurrent-depth model that runs some layers once per loop
    (``n_recurrent_loops``: one module, several outputs), or one whose decoder layers cannot be found as one module
    per cache layer, runs every layer (``of`` returns a replay that does nothing).
    """

    def __init__(self, layers: list[torch.nn.Module] | None):
        self.layers = layers
        self.outputs: list[object] = []

    @classmethod
    def of(cls, model: torch.nn.Module, count: int) -> _LayerReplay:
        config = resolve_config(model)
        if getattr(config, "num_kv_shared_layers", 0) or recurrent_loops(config) > 1:
            return cls(None)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", getattr(decoder, "h", None))  # GPT-2's family names them h
        if not isinstance(layers, torch.nn.ModuleList) or len({id(layer) for layer in layers}) != count:
            return cls(None)  # not found, or one module at two depths, whose outputs could not be told apart
        return cls(list(layers))

    @contextlib.contextmanager
    def recording(self):
        if self.layers is None:
            yield
            return
        self.outputs = [None] * len(self.layers)

        def keep(index):
            def hook(module, args, output):
                self.outputs[index] = output

            return hook

        hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    @contextlib.contextmanager
    def replaying(self, first: int):
        """Layers before ``first`` return the recorded outputs (an instance ``forward`` another library set, such as
        accelerate's offloading hook, is put back after)."""
        if self.layers is None or first == 0:
            yield
            return
        saved = []
        for layer, output in zip(self.layers[:first], self.outputs):
            saved.append(layer.__dict__.get("forward"))
            layer.forward = lambda *args, _output=output, **kwargs: _output
        try:
            yield
        finally:
            for layer, forward in zip(self.layers, saved):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward


def _check_chosen_by_search(cache_options: dict, where: str) -> None:
    """Refuse the options that set layers' key widths, which the search chooses."""
    for name in ("key_bits", "boundary_layers"):
        if name in cache_options:
            raise ValueError(f"{where}: {name} sets layers' key widths, which the search chooses; leave it out")


def _fingerprint(model: torch.nn.Module, cache: str, tokens: int) -> str:
    """A digest of what the widths depend on: the search's recipe, the model's config and dtype, a strided sample of
    each parameter (4,096 numbers: a fine-tuned model differs everywhere, so a sample tells it from its base without
    reading every weight) and the cache's resolved options (its repr)."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    header = {"format": _FORMAT, "search": AUTO_SEARCH, "tokens": tokens, "cache": cache, "config": config}
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        if param.device.type == "meta":  # offloaded by accelerate: its numbers are not here to read
            continue
        flat = param.detach().reshape(-1)
        digest.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


def _save(found: LayerKeyWidths, path) -> None:
    """Write the record where the next process finds it (via a temporary file, so a reader never sees half of it);
    a folder that cannot be written costs the next process the search again, not this one its widths."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        found.save(partial)
        partial.replace(path)
    except OSError as err:
        warnings.warn(
            f"key_bits='auto': could not keep the widths in {path} ({err}); the next process searches again",
            stacklevel=3,
        )
