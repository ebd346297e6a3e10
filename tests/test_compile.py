"""torch.compile: a decode step through each cache compiles with fullgraph=True (no graph break) and keeps the
cache's outputs; a few steps cost at most one recompile (sizes that grow become dynamic), not one per step."""

from __future__ import annotations

import pytest
from models import tiny_model

from hf_kvcache import make_cache

SPECS = ["int8", "int4:residual_length=4:group_size=8", "sink:window=8:sinks=2", "sink:window=8:sinks=2:bits=8"]


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
@pytest.mark.parametrize("spec", SPECS)
def test_decode_step_compiles_without_graph_breaks(spec, attn):
    """Under hf_kvcache the kernels are torch.library custom ops with fake implementations: opaque graph nodes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_model("llama", attn)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(3, 100, (6, 1), generator=torch.Generator().manual_seed(1))
    eager, compiled = make_cache(spec, model), make_cache(spec, model)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.forward, fullgraph=True)  # raises on any graph break
    with torch.no_grad():
        model(input_ids=ids, past_key_values=eager)
        model(input_ids=ids, past_key_values=compiled)
        for token in steps:
            want = model(input_ids=token.view(1, 1), past_key_values=eager).logits
            got = step(input_ids=token.view(1, 1), past_key_values=compiled).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.get_seq_length() == eager.get_seq_length() == 18
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
