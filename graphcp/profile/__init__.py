"""The ``graphcp profile`` command (``cli.py``) with its per-rank job (``job.py``), the
merged summary (``summary.py``), the Nsight Systems glue (``nsys.py``) and the bytes
each collective moves (``comm_bytes.py``). The NVTX ranges it reads are marked by the
library (:mod:`graphcp.nvtx_ranges`)."""
