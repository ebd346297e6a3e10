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
