"""The GPU decode path measured without a GPU: kernels compiled ahead of time for sm_80 / sm_90 (:mod:`.aot`) and the
report built from them (:mod:`.report`; ``python benchmarks/gpu_report.py`` or ``python -m
hf_kvcache.tools.gpu_report``)."""
