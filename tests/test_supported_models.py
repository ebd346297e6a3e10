"""The supported-models matrix (scripts/supported_models.py): the saved results cover every causal-LM type of the
installed transformers, the page renders from them, none of their cells is a crash or a wrong answer, and a fixed
spread of model types re-run here gives the same cells."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
from hf_kvcache.tools import supported_models  # noqa: E402

SAVED = json.loads(supported_models.SAVED.read_text())


# The page records one release (the newest supported: what CI installs). Under an older supported minor its cells
# are another release's (which models route attention through the AttentionInterface, which exist), so the checks
# that re-run models against it are skipped there; a patch release of the page's minor must re-run the matrix.
OTHER_MINOR = pytest.mark.skipif(
    Version(transformers.__version__).release[:2] != Version(SAVED["transformers"]).release[:2],
    reason=f"docs/supported-models.md records transformers {SAVED['transformers']}; this is {transformers.__version__}",
)


@OTHER_MINOR
def test_the_results_cover_every_causal_lm_type_of_the_installed_transformers():
    assert SAVED["transformers"] == transformers.__version__, "re-run scripts/supported_models.py --run"
    assert sorted(SAVED["families"]) == sorted(supported_models.rows())


@OTHER_MINOR  # the render groups refusals by taking out the installed release's model type names
def test_the_page_is_rendered_from_the_results():
    assert supported_models.PAGE.read_text() == supported_models.render(SAVED), (
        "docs/supported-models.md is stale: python scripts/supported_models.py --write"
    )


def test_no_cell_is_a_crash_an_unclear_refusal_or_a_wrong_answer():
    fails = [
        f"{model_type}/{attn}/{column}: {cell['detail']}"
        for model_type, row in SAVED["families"].items()
        for attn, cells in row.items()
        for column, cell in cells.items()
        if cell["status"] == "FAIL"
    ]
    assert not fails, fails


def test_refusals_are_one_line_and_name_the_model_type():
    for model_type, row in SAVED["families"].items():
        for cells in row.values():
            for column, cell in cells.items():
                if cell["status"] == "refused":
                    assert "\n" not in cell["detail"] and "'" in cell["detail"], (model_type, column, cell)


@OTHER_MINOR
@pytest.mark.parametrize("model_type", supported_models.SPREAD)
def test_a_spread_of_the_matrix_reproduces_its_saved_cells(model_type):
    """Statuses and refusal reasons equal the saved ones; lossy errors agree to rounding (same torch build)."""
    got = supported_models.run([model_type], verbose=False)[model_type]
    want = SAVED["families"][model_type]
    for attn, cells in want.items():
        for column, cell in cells.items():
            mine = got[attn][column]
            where = f"{model_type}/{attn}/{column}"
            assert mine["status"] == cell["status"], f"{where}: {mine} != saved {cell}"
            if "error" in cell:
                assert math.isclose(mine["error"], cell["error"], rel_tol=0.05, abs_tol=1e-3), where
                assert mine.get("flip") == cell.get("flip"), where
                for measured in ("before", "spread", "tempered"):
                    assert (measured in mine) == (measured in cell), f"{where}: {measured}"
                    if measured in cell:
                        assert math.isclose(mine[measured], cell[measured], rel_tol=0.05, abs_tol=1e-3), where
            elif cell["status"] in ("refused", "equal"):
                assert mine["detail"] == cell["detail"], where


def test_a_lossy_cells_error_over_constant_logits_is_zero_or_infinite_never_nan():
    """A tiny random XLM's logits are all equal (std 0): its lossy cells must read 0 where nothing differs."""
    import torch

    flat = torch.zeros(2, 5)
    assert supported_models._relative_error(flat, flat).tolist() == [0.0, 0.0]
    moved = flat.clone()
    moved[1, 0] = 1e-3
    assert supported_models._relative_error(moved, flat).tolist() == [0.0, float("inf")]
    want = torch.tensor([[0.0, 2.0, 4.0]])
    got = want + torch.tensor([[0.0, 0.5, 0.0]])
    assert supported_models._relative_error(got, want).tolist() == [0.25]  # 0.5 / std 2


def test_a_lossy_cells_error_is_its_compared_rows_alone():
    """A model that attends to its padding is compared on its unpadded row: the padded row's error must not count."""
    from types import SimpleNamespace

    import torch

    n = supported_models.NEW_TOKENS
    want = torch.tensor([[0.0, 2.0, 4.0]] * 2)
    ref = SimpleNamespace(sequences=torch.zeros(2, 3 + n, dtype=torch.long), logits=[want] * n)
    moved = want + torch.tensor([[0.0, 0.5, 0.0], [0.0, 9.0, 0.0]])
    out = SimpleNamespace(sequences=ref.sequences, logits=[moved] * n)
    assert supported_models._compare(ref, out, False, rows=slice(0, 1)) == (None, 0.25)
    assert supported_models._compare(ref, out, False) == (None, 4.5)


def test_routers_choices_are_recorded_per_forward_and_a_flip_is_found_where_it_is():
    import torch

    torch.set_num_threads(1)
    model = supported_models.build("qwen3_moe", "eager")
    with supported_models.recorded_choices(model, 2) as choices:
        supported_models._generate(model, None)
    assert len(choices) == supported_models.NEW_TOKENS  # one forward per new token
    assert all(len(step) == model.config.num_hidden_layers for step in choices)  # every layer's router
    assert choices[0][0].shape == (2, 10 * model.config.num_experts_per_tok)  # the prompt's 10 tokens a row
    assert choices[1][0].shape == (2, model.config.num_experts_per_tok)
    assert supported_models.first_flip(choices, choices) is None
    other = [[t.clone() for t in step] for step in choices]
    other[3][1][1] += 1  # row 1's choice at decode step 3
    assert supported_models.first_flip(choices, other) == 3
    assert supported_models.first_flip(choices, other, rows=slice(0, 1)) is None


def test_sharp_attention_is_measured_and_tempering_leaves_the_model_as_it_was():
    """Gemma 4 scales unit-RMS queries and keys by 1.0: its tiny model's scores spread about sqrt(head_dim) (its
    global layers' 512), every other model's here about 1; tempering puts each attention's scaling back."""
    import torch

    from hf_kvcache import make_cache

    torch.set_num_threads(1)
    sharp = supported_models.build("gemma4_text", "sdpa")
    spreads = supported_models.attention_spread(sharp)
    assert len(spreads) == sharp.config.num_hidden_layers
    assert max(spreads.values()) > 10 * supported_models.SHARP
    from transformers import PreTrainedModel

    models = [m for m in sharp.modules() if isinstance(m, PreTrainedModel)]
    assert {m.config._attn_implementation for m in models} == {"sdpa"}  # the recording attention is switched back
    before = {m: m.scaling for m in spreads}
    error = supported_models.tempered_error(sharp, "int8", spreads, make_cache)
    assert error is not None and error < 0.06
    assert {m: m.scaling for m in spreads} == before
    assert max(supported_models.attention_spread(supported_models.build("llama", "sdpa")).values()) < 1


def test_a_norm_on_the_attentions_output_is_found_and_bypassing_it_leaves_the_model_as_it_was():
    """Gemma 2 normalizes each attention's output before the residual add (its tiny random model's output scaled
    many times over); Llama adds it as it is (no such norm found, though one of its norms is named
    post_attention_layernorm). Bypassed, Gemma 2's int2 error falls under int2's bound; afterwards the model's logits
    are as before."""
    import torch
    from transformers import DynamicCache

    from hf_kvcache import make_cache

    torch.set_num_threads(1)
    model = supported_models.build("gemma2", "eager")
    norms = supported_models.attention_output_norms(model)
    assert set(norms) == {layer.post_attention_layernorm for layer in model.model.layers}
    assert min(norms.values()) > 5
    before = supported_models._generate(model, DynamicCache(config=model.config))
    spec = "int2:residual_length=2:group_size=8"
    with_norm = supported_models._compare(before, supported_models._generate(model, make_cache(spec, model)), False)[1]
    without = supported_models.unnormed_error(model, spec, norms, make_cache)
    assert without < 1.0 < with_norm
    after = supported_models._generate(model, DynamicCache(config=model.config))
    torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=0)
    assert supported_models.attention_output_norms(supported_models.build("llama", "sdpa")) == {}


def test_attention_computed_in_the_models_own_code_is_measured_from_its_projections():
    """CPM-Ant computes its scores itself (the recording attention function sees nothing) with 1.0-std random
    weights: its projections' scores spread far wider than SHARP; dividing its query projection by that spread
    brings int8 under its bound, and the weights are put back exactly."""
    import torch

    from hf_kvcache import make_cache

    torch.set_num_threads(1)
    model = supported_models.build("cpmant", "eager")
    assert supported_models.attention_spread(model) == {}
    spreads = supported_models.projected_spread(model)
    assert len(spreads) == model.config.num_hidden_layers
    assert min(spreads.values()) > 10 * supported_models.SHARP
    weights = [p.clone() for p in model.parameters()]
    assert supported_models.tempered_queries_error(model, "int8", spreads, make_cache, slice(0, 1)) < 0.06
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
