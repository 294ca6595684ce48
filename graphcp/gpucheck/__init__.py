"""The one-shot GPU check (``graphcp gpu-check``; ``scripts/gpu_check.py`` wraps it),
built to run on a lent GPU machine as it is (one GPU, no nvtx, no flashinfer, no
network, graphcp from the working tree). One job a module:

- :mod:`~graphcp.gpucheck.settings`: what a run checks (GPU defaults, ``--full``, ``--dry-run``'s tiny ones)
  and the budget it plans for;
- :mod:`~graphcp.gpucheck.budget`: the wall-clock budget and each part's share;
- :mod:`~graphcp.gpucheck.common`: logging, device and environment facts;
- :mod:`~graphcp.gpucheck.kernels`: Triton warm-up, every attention backend against the
  torch reference (the harness of :mod:`graphcp.attention.reference_cases`);
- :mod:`~graphcp.gpucheck.sparse_mla`: the DSA sparse MLA kernel past 32-bit offsets;
- :mod:`~graphcp.gpucheck.graphs`: graph replay equals the same-bucket eager body bitwise;
- :mod:`~graphcp.gpucheck.engines`: DeepSeek V4, MoE tp and ep, an EAGLE-3 draft's graphs
  (:mod:`~graphcp.gpucheck.draft_model` writes the draft);
- :mod:`~graphcp.gpucheck.hybrid`: a linear-attention hybrid on the machine's linear kernels
  (fla-core, causal-conv1d or the torch reference), its graphs and a varlen batch;
- :mod:`~graphcp.gpucheck.host`: one rank's host preparation, timed;
- :mod:`~graphcp.gpucheck.timing`: eager vs breakable vs full prefill;
- :mod:`~graphcp.gpucheck.launches`: launches per forward and ``torch.profiler`` traces;
- :mod:`~graphcp.gpucheck.moe_graph`: a MoE layer's grouped matmuls captured and replayed;
- :mod:`~graphcp.gpucheck.coverage`: what one GPU cannot check, and the commands that do;
- :mod:`~graphcp.gpucheck.report`: one JSON report, one Markdown summary, what fails a run;
- :mod:`~graphcp.gpucheck.run`: the parts in order; :mod:`~graphcp.gpucheck.cli`: the subcommand.

docs/gpu_check.md has the device command and the per-part budget.
"""
