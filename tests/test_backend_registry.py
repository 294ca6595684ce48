"""Attention backends register themselves (``@register_backend``) and declare their KV
layout, whether they preallocate per request and the limits they take; the registry
builds them by name from that declaration alone, and a limit it does not know is an
error, not dropped. No real kernel runs: FlashInfer is the fake of ``fake_flashinfer.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_cases import spec_for
from fake_flashinfer import Recorder, fake_flashinfer

from graphcp.attention import registry
from graphcp.attention.base import AttentionBackend
from graphcp.attention.catalog import AttentionLimits, register_backend, registered_backends, unregister_backend
from graphcp.options import ATTENTION_BACKENDS

ROOT = Path(__file__).resolve().parents[1]


class ToyAttention(AttentionBackend):
    """A backend defined here, not under graphcp/: it records what it was built with."""

    def __init__(self, spec, device="cpu", *, max_segments: int, dtype: torch.dtype = torch.float32,
                 workspace: torch.Tensor | None = None) -> None:
        super().__init__(spec)
        self.device, self.max_segments = torch.device(device), max_segments
        self.dtype, self.workspace = dtype, workspace

    def forward(self, q, kv_cache, meta, out, lse=None) -> None:
        out.zero_()


@pytest.fixture
def toy():
    cls = register_backend("toy", kv_layout="HND", per_request=True)(ToyAttention)
    try:
        yield cls
    finally:
        unregister_backend("toy")


@pytest.fixture
def fake_installed(monkeypatch):
    fi = fake_flashinfer(Recorder())
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", fi.prefill)


# ---- (a) a backend registered outside graphcp/ ------------------------------------------
def test_a_registered_backend_is_built_by_name_with_its_declared_facts(toy):
    spec = spec_for(16, "HND")
    shared = torch.zeros(8, dtype=torch.uint8)
    built = registry.make_attention("toy", spec, "cpu", AttentionLimits(max_segments=3, max_q_rows=9),
                                    workspace=shared)
    assert isinstance(built, ToyAttention) and built.name == "toy"
    # it is given the limits it names (max_q_rows it does not take), the device and the workspace it shares
    assert (built.max_segments, built.dtype, built.device, built.workspace) == (3, torch.float32,
                                                                                  torch.device("cpu"), shared)
    assert registry.preferred_kv_layout("toy") == "HND"
    assert registry.preallocates_per_request("toy")
    info = registry.backend_info("toy")
    assert (info.limits, info.required, info.takes_device, info.shares_workspace) == (
        ("max_segments", "dtype"), ("max_segments",), True, True)
    assert registry.resolve("toy", "cpu") == "toy"


def test_a_backend_refusing_the_device_refuses_before_construction(toy, monkeypatch):
    monkeypatch.setattr(ToyAttention, "device_problem", classmethod(lambda cls, device: f"no toy on {device}"))
    with pytest.raises(ValueError, match="^no toy on cpu$"):
        registry.make_attention("toy", spec_for(16, "HND"), "cpu", AttentionLimits(max_segments=3))


def test_the_toy_leaves_no_trace(toy):
    unregister_backend("toy")
    with pytest.raises(ValueError, match="unknown attention backend 'toy'; expected one of torch, triton, "
                                         "flashinfer, trtllm, auto"):
        registry.make_attention("toy", spec_for(16), "cpu")
    register_backend("toy")(ToyAttention)  # for the fixture's clean-up


def test_registration_refuses_a_taken_name_auto_a_bad_layout_and_an_unbuildable_constructor(toy):
    with pytest.raises(ValueError, match=r"'toy' is already registered \(ToyAttention\)"):
        register_backend("toy")(ToyAttention)
    with pytest.raises(ValueError, match="'auto' names the registry's choice"):
        register_backend("auto")(ToyAttention)
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND', got 'HDN'"):
        register_backend("toy2", kv_layout="HDN")(ToyAttention)

    class NeedsMore(ToyAttention):
        def __init__(self, spec, tile: int) -> None:
            super().__init__(spec, max_segments=1)

    with pytest.raises(TypeError, match="'toy2' .*needs tile, which make_attention cannot give"):
        register_backend("toy2")(NeedsMore)
    assert "toy2" not in registered_backends()


# ---- (b) limits are typed: an unknown one is an error ------------------------------------------
def test_an_unknown_limit_is_an_error_naming_it_and_the_known_ones():
    known = "max_segments, max_pages, max_pages_per_segment, max_q_rows, dtype"
    with pytest.raises(TypeError, match=f"unknown attention limit max_pages_per_seq; the limits are {known}$"):
        registry.make_attention("torch", spec_for(16), "cpu", max_segments=4, max_pages_per_seq=64)
    with pytest.raises(TypeError, match="unknown attention limits max_rows, block; the limits are max_segments"):
        registry.make_attention("torch", spec_for(16), "cpu", AttentionLimits(max_segments=4), max_rows=1, block=2)
    with pytest.raises(TypeError, match="max_segmnts"):
        AttentionLimits(max_segmnts=4)
    with pytest.raises(TypeError, match=r"limits must be an AttentionLimits, got dict \(a dict of limits: "):
        registry.make_attention("torch", spec_for(16), "cpu", {"max_segments": 4})


def test_a_required_limit_not_given_is_an_error_naming_it(fake_installed):
    with pytest.raises(TypeError, match=r"^attention backend 'flashinfer' needs the limits max_pages, max_q_rows "
                                        r"\(not given\); it takes max_segments, max_pages, max_q_rows, dtype$"):
        registry.make_attention("flashinfer", spec_for(16), "cpu", AttentionLimits(max_segments=2))


def test_limits_are_checked_values():
    with pytest.raises(ValueError, match="AttentionLimits: max_q_rows must be >= 1, got 0"):
        AttentionLimits(max_q_rows=0)
    with pytest.raises(ValueError, match="AttentionLimits: max_pages must be an integer, got 2.0"):
        AttentionLimits(max_pages=2.0)
    with pytest.raises(ValueError, match="AttentionLimits: dtype must be a torch.dtype, got 'bf16'"):
        AttentionLimits(dtype="bf16")
    assert AttentionLimits(max_segments=2, dtype=torch.float16).given() == {"max_segments": 2, "dtype": torch.float16}


def test_the_keyword_limits_set_on_top_of_the_object(fake_installed):
    fi = registry.make_attention("flashinfer", spec_for(16), "cpu",
                                 AttentionLimits(max_segments=2, max_pages=4, max_q_rows=8), max_q_rows=16,
                                 dtype=torch.float16)
    assert (fi.max_segments, fi.max_pages, fi.max_q_rows, fi.dtype) == (2, 4, 16, torch.float16)


# ---- (c) what the built-in backends declare ---------------------------------------------------
@pytest.mark.parametrize("name, layout, per_request", [
    ("torch", "NHD", False), ("triton", "NHD", False), ("flashinfer", "NHD", True), ("trtllm", "HND", True),
])
def test_built_in_backends_declare_their_layout_and_per_request_sizing(name, layout, per_request):
    info = registry.backend_info(name)
    assert (info.name, info.cls.name, info.kv_layout, info.per_request) == (name, name, layout, per_request)
    assert registry.preferred_kv_layout(name) == layout
    assert registry.preallocates_per_request(name) is per_request


def test_built_in_limits_and_the_options_agree():
    assert tuple(registered_backends()) == registry.BACKENDS == tuple(n for n in ATTENTION_BACKENDS if n != "auto")
    limits = {n: (i.limits, i.required) for n, i in registered_backends().items()}
    assert limits == {
        "torch": ((), ()), "triton": ((), ()),
        "flashinfer": (("max_segments", "max_pages", "max_q_rows", "dtype"),
                       ("max_segments", "max_pages", "max_q_rows")),
        "trtllm": (("max_segments", "max_pages_per_segment", "max_q_rows"),) * 2,
    }
    # only FlashInfer shares the ring's float workspace (trtllm-gen keeps zeroed counters in its own)
    assert [n for n, i in registered_backends().items() if i.shares_workspace] == ["flashinfer"]
    with pytest.raises(ValueError, match=r"unknown attention backend 'auto'.*\(resolve 'auto' first\)"):
        registry.backend_info("auto")


# ---- (d) registering imports no kernel library ------------------------------------------------
def test_importing_the_registry_imports_no_kernel_library():
    code = ("import sys, graphcp.attention.registry as r\n"
            "assert len(r.registered_backends()) == 4, r.registered_backends()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'triton')\n"
            "             or m == 'graphcp.attention.kernels.paged_prefill'))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]"
