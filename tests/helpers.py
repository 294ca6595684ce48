"""Small helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in float64); ``b`` is the reference."""
    a = torch.as_tensor(a).detach().to(torch.float64)
    b = torch.as_tensor(b).detach().to(torch.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    ref = b.norm()
    if ref == 0:
        return float((a - b).norm())
    return float((a - b).norm() / ref)


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a checkpoint folder (for tests that corrupt it)."""
    shutil.copytree(src, dst)
    return dst


def graph_then_eager(engine, toks, prefix, extends: int) -> dict:
    """The batch ``toks`` (request ``extends`` extending a cached ``prefix``) on the graph
    path, then eagerly: ``{"graph": PrefillOutput, "eager": PrefillOutput}`` (all logits;
    KV released)."""
    from graphcp import Request

    out = {}
    for path in ("graph", "eager"):
        h = engine.prefill([Request(prefix)]).handles[0]
        out[path] = engine.prefill([Request(t, h if j == extends else None) for j, t in enumerate(toks)],
                                   all_logits=True, force_eager=path == "eager")
        for x in out[path].handles:
            engine.release(x)
    return out
