"""The parts of ``scripts/gpu_check.py``, one job per module: ``common`` (settings,
budget, environment), ``kernels`` (Triton warm-up, attention kernels against the
torch reference), ``graphs`` (replay equals the same-bucket eager body),
``timing`` (eager vs breakable vs full, launches), ``trace`` (torch.profiler
trace with the graphcp ranges), ``report`` (JSON and Markdown)."""
