"""Choosing an attention backend by name.

Kernel libraries (triton, flashinfer) are imported only when their backend is
constructed; availability checks look for the package without importing it.

``auto``: CPU -> ``torch``. CUDA -> ``trtllm`` on SM100/SM103 with FlashInfer
installed (and an HND cache), else ``flashinfer`` if installed, else ``triton``
if installed, else ``torch``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable

import torch

from graphcp.attention.base import AttentionBackend, AttentionSpec
from graphcp.kv.layout import KVLayout
from graphcp.options import ATTENTION_BACKENDS

NAMES = ATTENTION_BACKENDS
BACKENDS = tuple(n for n in NAMES if n != "auto")

Capability = Callable[[torch.device], tuple[int, int]]


def _importable(package: str) -> bool:
    if package in sys.modules:  # already imported, or blocked with None
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(NAMES)}")


def resolve(
    name: str,
    device: torch.device | str,
    kv_layout: KVLayout | None = None,
    capability: Capability = _cuda_capability,
) -> str:
    """The concrete backend ``name`` stands for on ``device`` (``auto`` resolved)."""
    _check_name(name)
    if name != "auto":
        return name
    dev = torch.device(device)
    if dev.type != "cuda":
        return "torch"
    from graphcp.attention.backends.trtllm import SUPPORTED_CAPABILITIES

    has_fi = _importable("flashinfer")
    if has_fi and kv_layout in (None, "HND") and tuple(capability(dev)) in SUPPORTED_CAPABILITIES:
        return "trtllm"
    if has_fi:
        return "flashinfer"
    if _importable("triton"):
        return "triton"
    return "torch"


def available_backends(device: torch.device | str, capability: Capability = _cuda_capability) -> list[str]:
    """Backends that can run on ``device`` here (their packages are installed).
    On CPU, ``triton`` counts only under the interpreter (``TRITON_INTERPRET=1``)."""
    from graphcp.attention.backends.triton import interpreting
    from graphcp.attention.backends.trtllm import SUPPORTED_CAPABILITIES

    dev = torch.device(device)
    names = ["torch"]
    if _importable("triton") and (dev.type == "cuda" or interpreting()):
        names.append("triton")
    if dev.type == "cuda" and _importable("flashinfer"):
        names.append("flashinfer")
        if tuple(capability(dev)) in SUPPORTED_CAPABILITIES:
            names.append("trtllm")
    return names


def preferred_kv_layout(
    name: str, device: torch.device | str | None = None, capability: Capability = _cuda_capability
) -> KVLayout:
    """Cache layout to allocate for backend ``name``: HND for trtllm, NHD otherwise.
    ``auto`` needs ``device`` to know what it resolves to."""
    _check_name(name)
    if name == "auto":
        if device is None:
            raise ValueError("preferred_kv_layout('auto') needs the device to resolve the backend")
        name = resolve(name, device, capability=capability)
    return "HND" if name == "trtllm" else "NHD"


def _backend_class(name: str) -> type[AttentionBackend]:
    if name == "torch":
        from graphcp.attention.backends.torch_ref import TorchAttention as cls
    elif name == "triton":
        from graphcp.attention.backends.triton import TritonAttention as cls
    elif name == "flashinfer":
        from graphcp.attention.backends.flashinfer import FlashInferAttention as cls
    else:
        from graphcp.attention.backends.trtllm import TrtllmAttention as cls
    return cls


def make_attention(
    name: str, spec: AttentionSpec, device: torch.device | str, **kw
) -> AttentionBackend:
    """Build backend ``name`` for ``spec`` on ``device``. ``kw`` goes to the
    backend's constructor; options it does not take are dropped, so callers may
    pass the union (e.g. ``max_segments``). A missing required option still
    raises ``TypeError``."""
    chosen = resolve(name, device, spec.kv_layout)
    if chosen == "triton":
        from graphcp.attention.backends.triton import cpu_problem

        if (problem := cpu_problem(device)) is not None:  # not Triton's "0 active drivers" traceback
            raise ValueError(problem)
    cls = _backend_class(chosen)
    params = inspect.signature(cls.__init__).parameters
    # callers pass the union of options (e.g. max_segments); each backend takes its own
    kw = {k: v for k, v in kw.items() if k in params}
    if "device" in params:
        kw["device"] = device
    return cls(spec, **kw)
