"""How close a graph forward's outputs must be to the unpadded eager forward's: what
``graphcp run`` and the GPU check judge by, and the CPU tests' bound (the replay itself
must equal the same-bucket eager body bit for bit; the unpadded forward differs only by the
rounding of matmuls over padded rows). Relative: ||graph - eager|| / ||eager||."""

from __future__ import annotations

RUN_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
