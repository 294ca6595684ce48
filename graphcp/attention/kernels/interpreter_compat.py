"""The kernels under older Triton interpreters (Triton 3.6, the GPU image's version).

Triton's interpreter keeps a scalar as a one-element array of shape ``(1,)``. A loop
over a range read on the device (``for seg in range(seg_first, seg_last + 1)``, ``for
n0 in range(0, count, BLOCK_N)``) converts its bounds with ``__index__``; Triton 3.6
defines it as ``int(self.handle.data)``, which numpy 2 refuses for arrays of one
dimension ("only 0-dimensional arrays can be converted to Python scalars"). Triton 3.9
squeezes first. :func:`patch` makes every interpreter do what 3.9 does: it wraps the
interpreter's per-launch patching of ``tl.tensor`` and sets a squeezing ``__index__``
in the same restorable scope. Compiled kernels are untouched (nothing here runs unless
``TRITON_INTERPRET`` is set when a kernel module is imported).
"""

from __future__ import annotations

import numpy as np


def _index(self) -> int:
    return int(np.asarray(self.handle.data).squeeze())


def patch() -> None:
    """Idempotent; a no-op for an interpreter without the per-launch tensor patching."""
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "graphcp_squeezes_index", False):
        return

    def patched(tensor, scope, *args, **kwargs):
        orig(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _index)

    patched.graphcp_squeezes_index = True
    interpreter._patch_lang_tensor = patched
