"""Choosing an attention backend by name, and building it.

Backends register themselves (:func:`~graphcp.attention.catalog.register_backend` in
their own modules; importing this module imports :mod:`graphcp.attention.backends`, so
every built-in one is registered). Their declared facts are read here: the cache layout
(:func:`preferred_kv_layout`), whether they preallocate per request
(:func:`preallocates_per_request`) and the :class:`AttentionLimits` each takes
(:func:`make_attention`).

Kernel libraries (triton, flashinfer) are imported only when their backend is
constructed or its kernels run; availability checks look for the package without
importing it.

``auto``: CPU -> ``torch``. CUDA -> ``trtllm`` on SM100/SM103 with FlashInfer
installed (and an HND cache), else ``flashinfer`` if installed, else ``triton``
if installed, else ``torch``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch

import graphcp.attention.backends  # noqa: F401 - registers every built-in backend (and their decode kernels)
import graphcp.attention.decode.paged  # noqa: F401 - registers the torch reference decode kernel
from graphcp.attention.backends.triton import interpreting
from graphcp.attention.backends.trtllm import SUPPORTED_CAPABILITIES
from graphcp.attention.base import AttentionBackend, AttentionSpec
from graphcp.attention.catalog import (
    AttentionLimits,
    BackendInfo,
    register_backend,
    registered_backends,
    registered_decode_backends,
)
from graphcp.kv.layout import KVLayout
from graphcp.options import ATTENTION_BACKENDS

#: the names the options offer (built-in backends and ``auto``); a backend registered
#: elsewhere is built by name too, but is not an option
NAMES = ATTENTION_BACKENDS
BACKENDS = tuple(n for n in NAMES if n != "auto")

Capability = Callable[[torch.device], tuple[int, int]]

__all__ = [
    "NAMES", "BACKENDS", "AttentionLimits", "BackendInfo", "register_backend", "backend_info",
    "preallocates_per_request", "resolve", "available_backends", "preferred_kv_layout", "make_attention",
    "registered_decode_kernel", "decode_kernel_info", "make_decode_attention",
]


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
    if name != "auto" and name not in registered_backends():
        raise ValueError(f"unknown attention backend {name!r}; expected one of "
                         f"{', '.join([*registered_backends(), 'auto'])}")


def backend_info(name: str) -> BackendInfo:
    """What backend ``name`` (a concrete one, not ``auto``) declared when it registered."""
    info = registered_backends().get(name)
    if info is None:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(registered_backends())}"
                         + (" (resolve 'auto' first)" if name == "auto" else ""))
    return info


def preallocates_per_request(name: str) -> bool:
    """Whether backend ``name`` preallocates per request (so a batch may hold at most
    ``RuntimeConfig.max_requests``)."""
    return backend_info(name).per_request


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
    """Cache layout to allocate for backend ``name``: the one it registered (HND for
    trtllm, NHD for the others). ``auto`` needs ``device`` to know what it resolves to."""
    _check_name(name)
    if name == "auto":
        if device is None:
            raise ValueError("preferred_kv_layout('auto') needs the device to resolve the backend")
        name = resolve(name, device, capability=capability)
    return backend_info(name).kv_layout


def make_attention(
    name: str,
    spec: AttentionSpec,
    device: torch.device | str,
    limits: AttentionLimits | None = None,
    *,
    workspace: torch.Tensor | None = None,
    **given: object,
) -> AttentionBackend:
    """Build backend ``name`` for ``spec`` on ``device``. ``limits`` (with any keyword
    limits ``given`` set on top) holds the union of sizes callers know; each backend is
    passed the ones it takes. A keyword that is not a limit is a TypeError naming it,
    and so is a limit the backend requires but ``limits`` does not give.
    ``workspace``: a float workspace to share, for a backend that shares one (the ring's
    steps run one after another); the others allocate their own."""
    info = backend_info(resolve(name, device, spec.kv_layout))
    limits = AttentionLimits.of(limits, **given)
    if (problem := info.cls.device_problem(device)) is not None:
        raise ValueError(problem)  # e.g. Triton on a CPU without its interpreter, in one line
    return info.cls(spec, **_constructor_args(info, limits, device, workspace))


def registered_decode_kernel(backend: AttentionBackend | str) -> BackendInfo | None:
    """The decode kernel registered for ``backend`` (an engine's attention backend, or a
    registered backend's name); None for any other (a family's own, whatever its name)."""
    kernels = registered_decode_backends()
    if isinstance(backend, str):
        return kernels.get(backend)
    info = registered_backends().get(getattr(backend, "name", None))
    return kernels.get(info.name) if info is not None and isinstance(backend, info.cls) else None


def decode_kernel_info(backend: AttentionBackend | str) -> BackendInfo:
    """The decode kernel a decode graph captures for ``backend``: its registered one, or
    the torch reference (a family's own backend)."""
    return registered_decode_kernel(backend) or registered_decode_backends()["torch"]


def make_decode_attention(backend: AttentionBackend, device: torch.device | str,
                          limits: AttentionLimits | None = None) -> AttentionBackend:
    """Build the decode kernel of an engine's attention ``backend`` for its spec on
    ``device`` (graphcp.attention.base.DecodeKernel): what a decode graph captures, and an
    eager decode step runs when it takes a batch of any size (``any_batch``). ``limits``:
    the largest bucket's rows (``max_segments``, ``max_q_rows``), the page table's width
    (``max_pages_per_segment``) and the dtype, each kernel taking the ones it names."""
    info = decode_kernel_info(backend)
    limits = AttentionLimits.of(limits)
    if (problem := info.cls.device_problem(device)) is not None:
        raise ValueError(problem)
    return info.cls(backend.spec, **_constructor_args(info, limits, device, None))


def _constructor_args(info: BackendInfo, limits: AttentionLimits, device: torch.device | str,
                      workspace: torch.Tensor | None) -> dict[str, object]:
    have = limits.given()
    missing = [n for n in info.required if n not in have]
    if missing:
        raise TypeError(f"attention backend {info.name!r} needs the limit{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)} (not given); it takes {', '.join(info.limits)}")
    kw: dict[str, object] = {n: have[n] for n in info.limits if n in have}
    if info.takes_device:
        kw["device"] = device
    if info.shares_workspace and workspace is not None:
        kw["workspace"] = workspace
    return kw
