"""What an attention backend declares when it registers, and the limits it is sized by.

A backend module applies :func:`register_backend` to its class::

    @register_backend("flashinfer", kv_layout="NHD", per_request=True)
    class FlashInferAttention(AttentionBackend): ...

recording a :class:`BackendInfo`: the cache layout to allocate for it, whether it
preallocates per request (so a batch may hold at most ``RuntimeConfig.max_requests``),
and which :class:`AttentionLimits` its constructor takes (the fields its ``__init__``
names; those without a default are required). Registering imports no kernel library:
a backend imports its library only when constructed or when its kernels run.

This module sits below the backends and :mod:`graphcp.attention.registry` (no cycle):
the registry imports :mod:`graphcp.attention.backends`, which registers every built-in
backend, before it looks a name up. Look names up through the registry.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphcp.checks import check_int
from graphcp.kv.layout import KVLayout

if TYPE_CHECKING:
    from graphcp.attention.base import AttentionBackend

#: constructor parameters make_attention fills besides the limits
_SPEC, _DEVICE, _WORKSPACE = "spec", "device", "workspace"


@dataclass(frozen=True)
class AttentionLimits:
    """Static sizes a backend preallocates for; each backend takes the fields its
    constructor names. None: not given (a backend that requires it refuses)."""

    #: segments of one forward (zigzag: two a request)
    max_segments: int | None = None
    #: page-table entries of one forward, over all its segments
    max_pages: int | None = None
    #: pages one segment's request can span (the model's context in pages)
    max_pages_per_segment: int | None = None
    #: query rows of one forward on this rank
    max_q_rows: int | None = None
    #: dtype of q and the cache (what a planner sizes by)
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "dtype":
                if not isinstance(value, torch.dtype):
                    raise ValueError(f"AttentionLimits: dtype must be a torch.dtype, got {value!r}")
            else:
                check_int(value, f.name, lo=1, where="AttentionLimits", err=ValueError)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, base: AttentionLimits | None = None, **given: object) -> AttentionLimits:
        """``base`` (None: no limits) with the keyword limits ``given`` set; a name that
        is not a limit is a TypeError naming it and the known ones (not dropped)."""
        if base is not None and not isinstance(base, AttentionLimits):
            raise TypeError(f"limits must be an AttentionLimits, got {type(base).__name__} (a dict of limits: "
                            "AttentionLimits(**limits))")
        unknown = [k for k in given if k not in cls.names()]
        if unknown:
            raise TypeError(f"unknown attention limit{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the limits are {', '.join(cls.names())}")
        return dataclasses.replace(base if base is not None else cls(), **given)

    def given(self) -> dict[str, object]:
        """The limits set (not None), by name."""
        return {k: getattr(self, k) for k in self.names() if getattr(self, k) is not None}


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend: what :func:`register_backend` recorded."""

    name: str
    cls: type[AttentionBackend]
    #: the cache layout to allocate for it (trtllm-gen reads only HND)
    kv_layout: KVLayout
    #: it preallocates per request (sized by max_segments): a batch may hold at most max_requests
    per_request: bool
    #: the AttentionLimits fields its constructor takes, and those of them without a default
    limits: tuple[str, ...]
    required: tuple[str, ...]
    #: its constructor takes the device / a float workspace to share (ring steps run one after another)
    takes_device: bool
    shares_workspace: bool


_TABLE: dict[str, BackendInfo] = {}
#: attention backend name -> the decode kernel a decode graph captures for it
_DECODE: dict[str, BackendInfo] = {}


def register_backend(name: str, *, kv_layout: KVLayout = "NHD", per_request: bool = False) -> Callable[[type], type]:
    """Class decorator: record the backend class under ``name`` (and set its ``name``)."""

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        info = _info(name, cls, kv_layout, per_request)
        if name in _TABLE:
            raise ValueError(f"attention backend {name!r} is already registered ({_TABLE[name].cls.__qualname__})")
        cls.name = name
        _TABLE[name] = info
        return cls

    return register


def register_decode_backend(name: str) -> Callable[[type], type]:
    """Class decorator: record the class (a :class:`~graphcp.attention.base.DecodeKernel`)
    as the decode kernel a decode graph captures when the engine's attention backend is
    ``name`` (graphcp.runtime.capture.phases.DecodeGraphs). Its constructor takes what a
    backend's may (spec, device, the limits)."""

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _DECODE:
            raise ValueError(f"a decode kernel for attention backend {name!r} is already registered "
                             f"({_DECODE[name].cls.__qualname__})")
        _DECODE[name] = _info(name, cls, "NHD", False)
        return cls

    return register


def registered_decode_backends() -> dict[str, BackendInfo]:
    """Attention backend name -> its decode kernel, registered so far (a copy)."""
    return dict(_DECODE)


def unregister_backend(name: str) -> BackendInfo:
    """Remove ``name`` from the table (a test's own backend, after the test)."""
    if name not in _TABLE:
        raise KeyError(f"attention backend {name!r} is not registered")
    return _TABLE.pop(name)


def registered_backends() -> dict[str, BackendInfo]:
    """The backends registered so far, in registration order (a copy). Every built-in
    one is registered once :mod:`graphcp.attention.registry` is imported."""
    return dict(_TABLE)


def _info(name: str, cls: type, kv_layout: KVLayout, per_request: bool) -> BackendInfo:
    if name == "auto":
        raise ValueError("'auto' names the registry's choice, not a backend")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"attention backend {name!r}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop(next(iter(params)))  # self
    known = {_SPEC, _DEVICE, _WORKSPACE, *AttentionLimits.names()}
    # make_attention gives only these: a constructor that needs anything else cannot be built by name
    unfillable = [p.name for p in params.values() if p.name not in known and p.default is p.empty
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unfillable:
        raise TypeError(f"attention backend {name!r} ({cls.__qualname__}) needs {', '.join(unfillable)}, which "
                        f"make_attention cannot give (it gives spec, device, workspace and the limits "
                        f"{', '.join(AttentionLimits.names())})")
    limits = tuple(n for n in AttentionLimits.names() if n in params)
    required = tuple(n for n in limits if params[n].default is params[n].empty)
    return BackendInfo(name, cls, kv_layout, bool(per_request), limits, required, _DEVICE in params,
                       _WORKSPACE in params)
