"""Profiling: NVTX ranges the library marks (``ranges.py``), and the ``graphcp profile``
command (``cli.py``) with its per-rank job (``job.py``), the merged summary
(``summary.py``) and the Nsight Systems glue (``nsys.py``)."""
