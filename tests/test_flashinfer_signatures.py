"""Every FlashInfer call graphcp makes, bound to the *real* signatures.

The recording fakes (``fake_flashinfer.py``) keep each call's arguments exactly
as graphcp passed them; here they are bound with ``inspect.signature(...).bind``
to the functions of the installed flashinfer, and every argument whose real
annotation is a tensor, int, float, bool or str must have that type. Skipped
where flashinfer is not importable (CI installs no flashinfer; the real kernels
are never called, so a CPU machine with the package installed runs it).
"""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from backend_cases import EXAMPLE, num_pages_for, spec_for, static_meta, zigzag_meta  # noqa: E402
from fake_flashinfer import SM_COUNT, Recorder, fake_flashinfer  # noqa: E402

from graphcp.attention.backends.flashinfer import FlashInferAttention  # noqa: E402
from graphcp.attention.backends.flashinfer_decode import FlashInferDecodeAttention  # noqa: E402
from graphcp.attention.backends.trtllm import TrtllmAttention  # noqa: E402
from graphcp.attention.backends.trtllm_decode import TrtllmDecodeAttention  # noqa: E402
from graphcp.attention.reference_cases import decode_case, run_decode_case, tensors  # noqa: E402

PLAIN = (torch.Tensor, bool, int, float, str)


def _real(name: str):
    obj = flashinfer
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _allowed(hint) -> tuple[type, ...] | None:
    """The plain types an annotation admits, or None when it is not that simple."""
    if hint is typing.Any:
        return None
    args = typing.get_args(hint)
    options = args if typing.get_origin(hint) is typing.Union else (hint,)
    out = []
    for t in options:
        if t is type(None):
            out.append(type(None))
        elif t in PLAIN:
            out.append(t)
        elif typing.get_origin(t) is typing.Literal:
            out.extend(type(v) for v in typing.get_args(t))
        else:
            return None  # a tuple, a list, a dtype union...: binding by name is all we check
    return tuple(out)


def _check_binds(rec: Recorder) -> set[str]:
    seen = set()
    for name, args, kwargs in rec.raw:
        fn = _real(name)
        sig = inspect.signature(fn)
        is_method = "." in name and not name.startswith(("prefill.", "decode."))
        bound = sig.bind(*((None,) if is_method else ()), *args, **kwargs)  # TypeError on a bad name/order
        hints = typing.get_type_hints(fn)
        for arg, value in bound.arguments.items():
            allowed = _allowed(hints[arg]) if arg in hints else None
            if allowed is None or sig.parameters[arg].kind is inspect.Parameter.VAR_POSITIONAL:
                continue
            if float in allowed:
                allowed += (int,)  # an int is a fine float
            assert isinstance(value, allowed) and not isinstance(value, np.generic), (
                f"{name}: {arg}={value!r} is {type(value).__name__}, the real signature says {hints[arg]}")
        seen.add(name)
    return seen


def test_flashinfer_wrapper_calls_bind_to_the_real_signatures():
    rec = Recorder()
    spec = spec_for(16)
    fi = FlashInferAttention(spec, "cpu", max_segments=8, max_pages=40, max_q_rows=80, dtype=torch.bfloat16,
                             flashinfer=fake_flashinfer(rec, (9, 0)))
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, lse = tensors(spec, 80, 40)
    fi.prepare(meta)
    fi.forward(q, kv, meta, out, lse)
    fi.forward(q, kv, meta, out)
    smeta = static_meta(8, 8, 16, 80, *(torch.zeros(s, dtype=torch.int32) for s in (9, 8)),
                        torch.zeros(8, 8, dtype=torch.int32))
    fi.prepare(smeta)
    fi.forward(q, kv, smeta, out, lse)
    assert _check_binds(rec) == {"BatchPrefillWithPagedKVCacheWrapper." + m for m in ("__init__", "plan", "run")}


def test_trtllm_calls_bind_to_the_real_signature():
    rec = Recorder()
    spec = spec_for(16, "HND")
    for static in (False, True):
        lengths = dict(static_max_q_len=24, static_max_kv_len=128) if static else {}
        trt = TrtllmAttention(spec, "cpu", max_segments=6, max_pages_per_segment=8, max_q_rows=24,
                              capability=lambda: (10, 0), sm_count=SM_COUNT, flashinfer=fake_flashinfer(rec),
                              **lengths)
        meta = zigzag_meta(**EXAMPLE)
        q, kv, out, lse = tensors(spec, 24, num_pages_for(meta))
        trt.prepare(meta)
        trt.forward(q, kv, meta, out, lse)
        trt.forward(q, kv, meta, out)
        if static:  # a full-graph capture's call: the whole q
            smeta = static_meta(6, 8, 16, 24, *(torch.zeros(s, dtype=torch.int32) for s in (7, 6)),
                                torch.zeros(6, 8, dtype=torch.int32))
            trt.prepare(smeta)
            trt.forward(q, kv, smeta, out, lse)
    assert _check_binds(rec) == {"prefill.trtllm_batch_context_with_kv_cache"}
    assert len(rec.raw) == 5


def _decode_cases(layout: str) -> list:
    spec = spec_for(16, layout)
    return [decode_case(lens, spec, torch.bfloat16, "cpu", torch.Generator().manual_seed(j), np.random.default_rng(j),
                        rows=4, width=8) for j, lens in enumerate(([40, 0, 3], [0, 0, 0, 0]))]


def test_flashinfer_decode_wrapper_calls_bind_to_the_real_signatures():
    rec = Recorder()
    kernel = FlashInferDecodeAttention(spec_for(16), "cpu", max_pages_per_segment=8, dtype=torch.bfloat16,
                                       flashinfer=fake_flashinfer(rec), workspace_bytes=1 << 20)
    for case in _decode_cases("NHD"):
        for with_lse in (True, False):
            assert run_decode_case(kernel, case, with_lse).ok
    assert _check_binds(rec) == {"BatchDecodeWithPagedKVCacheWrapper." + m for m in ("__init__", "plan", "run")}
    # plan takes **kwargs: its keywords are _plan_impl's (an unknown one raises TypeError there)
    impl = inspect.signature(flashinfer.BatchDecodeWithPagedKVCacheWrapper._plan_impl)
    plans = [(a, k) for n, a, k in rec.raw if n.endswith(".plan")]
    assert plans and all(impl.bind(None, *a, **k) for a, k in plans)


def test_trtllm_decode_calls_bind_to_the_real_signature():
    rec = Recorder()
    kernel = TrtllmDecodeAttention(spec_for(16, "HND"), "cpu", max_segments=4, max_pages_per_segment=8,
                                   capability=lambda: (10, 0), sm_count=SM_COUNT, flashinfer=fake_flashinfer(rec))
    for case in _decode_cases("HND"):
        for with_lse in (True, False):
            assert run_decode_case(kernel, case, with_lse).ok
    assert _check_binds(rec) == {"decode.trtllm_batch_decode_with_kv_cache"} and len(rec.raw) == 4
