"""The GPU run: everything we measure on a GPU, in one time-boxed command (:mod:`.runner`).

Stages, in order, each a module with ``run(record, device, smoke)`` and ``headline(record)``: :mod:`.env`,
:mod:`.correctness`, :mod:`.kernels`, :mod:`.generate`, :mod:`.quality`. ``python -m hf_kvcache.tools.gpu_run
--output DIR`` (or ``benchmarks/gpu_run.py``) runs them; ``--smoke`` runs every stage at tiny shapes in seconds, on
CPU too, which is how the test suite keeps it from rotting between GPU loans. :mod:`.render` turns the JSON into the
docs' tables.
"""

from .runner import DEFAULT_BUDGET_S, STAGES, main

__all__ = ["DEFAULT_BUDGET_S", "STAGES", "main"]
