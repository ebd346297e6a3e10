"""torch.compile: a decode step through each cache compiles with fullgraph=True (no graph break) and keeps the
cache's outputs; a few steps cost at most one recompile (sizes that grow become dynamic), not one per step."""

from __future__ import annotations

import pytest
from models import tiny_model

from hf_kvcache import make_cache

SPECS = ["int8", "int4:residual_length=4:group_size=8", "sink:window=8:sinks=2", "sink:window=8:sinks=2:bits=8"]
# What a cache can break is Dynamo's capture (graph breaks, recompiles) and AOTAutograd's trace through the custom
# ops' fake implementations: the "aot_eager" backend runs both and generates no code. Inductor's code generation (the
# default backend's last step, 3-5x the time of the rest on CPU) runs for one cache under each attention path, in
# place of that pair's aot_eager case (inductor's capture is the same Dynamo and AOTAutograd trace, then compiled).
INDUCTOR = [("int8", "sdpa"), (SPECS[1], "hf_kvcache")]
CASES = [(spec, attn, "aot_eager") for spec in SPECS for attn in ("sdpa", "hf_kvcache") if (spec, attn) not in INDUCTOR]
CASES += [(spec, attn, "inductor") for spec, attn in INDUCTOR]


@pytest.mark.slow
@pytest.mark.parametrize("spec, attn, backend", CASES)
def test_decode_step_compiles_without_graph_breaks(spec, attn, backend):
    """Under hf_kvcache the kernels are torch.library custom ops with fake implementations: opaque graph nodes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_model("llama", attn)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(3, 100, (6, 1), generator=torch.Generator().manual_seed(1))
    eager, compiled = make_cache(spec, model), make_cache(spec, model)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.forward, fullgraph=True, backend=backend)  # raises on any graph break
    with torch.no_grad():
        model(input_ids=ids, past_key_values=eager)
        model(input_ids=ids, past_key_values=compiled)
        for token in steps:
            want = model(input_ids=token.view(1, 1), past_key_values=eager).logits
            got = step(input_ids=token.view(1, 1), past_key_values=compiled).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.get_seq_length() == eager.get_seq_length() == 18
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_paged_decode_compiles_with_graph_breaks_not_fullgraph(attn):
    """The paged cache's block bookkeeping is Python that runs every forward (the source of truth for sharing and
    copy-on-write): fullgraph refuses it, as the paged page says; a plain compile breaks around it and stays exact.

    Where the refusal comes depends on torch: up to 2.13 Dynamo refuses the first step; 2.14 and 2.15 trace the first
    step with the bookkeeping's integers as constants and refuse the second, once a recompile makes them symbolic
    (``divmod`` of symbolic integers). What holds on every release: a refusal within two steps, each step that ran
    equal to eager, and the cache consistent after the refusal (the refused step stored nothing)."""
    import torch._dynamo

    model = tiny_model("llama", attn)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(3, 100, (4, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch._dynamo.reset()
        eager, compiled = make_cache("paged:block_size=4", model), make_cache("paged:block_size=4", model)
        model(input_ids=ids, past_key_values=eager)
        model(input_ids=ids, past_key_values=compiled)
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        with pytest.raises(torch._dynamo.exc.Unsupported):
            for token in steps[:2]:
                got = step(input_ids=token.view(1, 1), past_key_values=compiled).logits
                want = model(input_ids=token.view(1, 1), past_key_values=eager).logits
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        compiled.check_invariants()
        assert compiled.get_seq_length() == eager.get_seq_length()  # the refused step left no token behind
        torch._dynamo.reset()
        eager, compiled = make_cache("paged:block_size=4", model), make_cache("paged:block_size=4", model)
        model(input_ids=ids, past_key_values=eager)
        model(input_ids=ids, past_key_values=compiled)
        step = torch.compile(model.forward, backend="aot_eager")
        for token in steps:
            want = model(input_ids=token.view(1, 1), past_key_values=eager).logits
            got = step(input_ids=token.view(1, 1), past_key_values=compiled).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        compiled.check_invariants()


KERNEL_SPECS = [
    "int8",
    "int4:residual_length=4:group_size=8",
    "int3:residual_length=4:group_size=8",
    "int2:residual_length=4:group_size=8:smooth=1",  # the query divided by the scales before the kernels' op
    "paged:bits=8",
]


def _custom_ops_called(step) -> set[str]:
    """The ``hf_kvcache::`` ops that reach the dispatcher while ``step()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "hf_kvcache":
                seen.add(func._opname)
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    return seen


@pytest.mark.parametrize("spec", KERNEL_SPECS)
def test_eager_decode_calls_the_kernels_without_the_dispatcher(spec, monkeypatch):
    """Eager code calls each kernel's implementation directly (the custom op's wrappers cost more host time than a
    short decode step's kernels take on a GPU); torch.compile still sees the custom ops, one opaque node each, and
    both compute the same step."""
    import torch
    import torch._dynamo

    from hf_kvcache.layers import _common

    monkeypatch.setattr(_common, "CPU_HANDLES", "always")  # the kernels' path at a tiny model's lengths
    model = tiny_model("llama", "hf_kvcache")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    token = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(1))
    eager, compiled = make_cache(spec, model), make_cache(spec, model)
    targets: set[str] = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        model(input_ids=ids, past_key_values=eager)
        model(input_ids=ids, past_key_values=compiled)
        out = {}
        called = _custom_ops_called(lambda: out.update(want=model(input_ids=token, past_key_values=eager).logits))
        assert called == set(), called
        torch._dynamo.reset()
        got = torch.compile(model.forward, backend=backend)(input_ids=token, past_key_values=compiled).logits
    torch.testing.assert_close(got, out["want"], rtol=1e-4, atol=1e-4)
    partials = {t for t in targets if t.startswith("hf_kvcache.partial_")}
    assert partials and "hf_kvcache.combine.default" in targets, sorted(targets)
