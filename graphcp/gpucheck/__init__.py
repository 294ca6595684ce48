"""The one-shot GPU check (``graphcp gpu-check``; ``scripts/gpu_check.py`` wraps it),
built to run on a lent GPU machine as it is: torch + triton + safetensors + tqdm,
no nvtx, no flashinfer, no network, graphcp from the working tree. One job a module:

- :mod:`~graphcp.gpucheck.settings`: what a run checks (GPU defaults, ``--dry-run``'s tiny ones);
- :mod:`~graphcp.gpucheck.budget`: the wall-clock budget and each part's share;
- :mod:`~graphcp.gpucheck.common`: logging, device and environment facts;
- :mod:`~graphcp.gpucheck.kernels`: Triton warm-up, every attention backend against the
  torch reference (the harness of :mod:`graphcp.attention.reference_cases`);
- :mod:`~graphcp.gpucheck.graphs`: graph replay equals the same-bucket eager body bitwise;
- :mod:`~graphcp.gpucheck.timing`: eager vs breakable vs full prefill;
- :mod:`~graphcp.gpucheck.launches`: launches per forward and ``torch.profiler`` traces;
- :mod:`~graphcp.gpucheck.report`: one JSON report and one Markdown summary;
- :mod:`~graphcp.gpucheck.run`: the parts in order; :mod:`~graphcp.gpucheck.cli`: the subcommand.

docs/gpu_check.md has the device command and the per-part budget.
"""
