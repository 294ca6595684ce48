#!/usr/bin/env python
"""The one-shot GPU check, ``graphcp gpu-check`` (graphcp/gpucheck/, docs/gpu_check.md),
for a machine where graphcp is not installed: from the repository root,

    PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"
"""

import sys

from graphcp.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["gpu-check", *sys.argv[1:]]))
