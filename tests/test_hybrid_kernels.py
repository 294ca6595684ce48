"""The hybrid's GPU kernels' wiring (graphcp.model.hybrid.kernels), on the CPU through
fakes that model the libraries' contracts: fla-core's ``chunk_gated_delta_rule`` (``[B, T,
H, K]`` inputs, log decays, ``initial_state`` ``[B, H, K, V]``, a token-by-token
recurrence: not graphcp's chunked code) and causal-conv1d's ``causal_conv1d_fn``
(channel-last ``x`` and ``initial_states``, the library's reference semantics). The
engine with both at CP 2 equals the torch reference path, and every call is bound to the
installed functions' signatures where the libraries import (their kernels never run here).
"""

from __future__ import annotations

import inspect
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.hybrid import kernels

CALLS: dict[str, list] = {"fla": [], "conv": []}


def fake_fla_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    """fla's contract, token by token: ``S = S exp(g) + k (beta (v - k^T S))``, ``o = scale q^T S``."""
    CALLS["fla"].append(((q, k, v, g, beta), dict(scale=scale, initial_state=initial_state,
                                                  output_final_state=output_final_state, **kw)))
    B, T, H, K = k.shape
    assert q.shape == k.shape and v.shape[:3] == (B, T, H) and g.shape == beta.shape == (B, T, H) and K <= 256
    assert initial_state.shape == (B, H, K, v.shape[-1]) and all(x.is_contiguous() for x in (q, k, v, g, beta))
    state, out = initial_state.clone(), torch.empty_like(v)
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        delta = (v[:, t] - (state * kt[..., None]).sum(-2)) * beta[:, t][..., None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = scale * (state * q[:, t][..., None]).sum(-2)
    return out, state if output_final_state else None


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    """causal-conv1d's contract (its causal_conv1d_ref): channel-last x and initial states."""
    CALLS["conv"].append(((x, weight, bias, seq_idx, initial_states), dict(activation=activation)))
    assert x.stride(1) == 1 and initial_states.stride(1) == 1 and activation == "silu"
    assert initial_states.shape == (*x.shape[:2], weight.shape[1] - 1)
    full = torch.cat([initial_states, x], dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out).to(x.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    """The fake modules installed, and select_kernels giving the CUDA choice on this CPU."""
    fla, ops, gdr = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))
    gdr.chunk_gated_delta_rule = fake_fla_rule
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = fake_causal_conv1d_fn
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, mod)
    chosen = kernels.LinearKernels("fla+causal-conv1d", kernels.fla_rule(), kernels.causal_conv1d_conv())
    monkeypatch.setattr(kernels, "select_kernels", lambda device: chosen)
    for calls in CALLS.values():
        calls.clear()
    return chosen


def _job(group, folder):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024), group)
    rng = np.random.default_rng(1)
    toks = [rng.integers(0, 512, n) for n in (3, 70)]
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    head = eng.prefill([Request(toks[1][:30])])
    tail = eng.prefill([Request(toks[1][30:], head.handles[0])], all_logits=True)
    return [x.clone() for x in one.logits] + [tail.logits[0].clone()], one.info.stats["linear_kernels"]


def test_the_cuda_kernels_wiring_equals_the_torch_path(hf_model_dir, fake_kernels):
    folder = hf_model_dir("qwen3_5_text")
    got, name = launch(_job, 2, folder)[0]
    assert name == "fla+causal-conv1d" and CALLS["fla"] == [] and CALLS["conv"] == []  # (the calls ran on the ranks)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "select_kernels", lambda device: kernels.TORCH)
        want, torch_name = launch(_job, 2, folder)[0]
    assert torch_name == "torch"
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_the_calls_bind_to_the_installed_signatures(hf_model_dir, fake_kernels):
    """Each recorded call bound to the real function (skipped where a library does not import)."""
    PrefillEngine(hf_model_dir("qwen3_5_text"), RuntimeConfig(kv_tokens=1024)).prefill([Request([1, 2, 3, 4, 5])])
    assert CALLS["fla"] and CALLS["conv"]
    for lib, module, fn in (("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                            ("conv", "causal_conv1d", "causal_conv1d_fn")):
        real = _installed(module, fn)
        for args, kwargs in CALLS[lib]:
            inspect.signature(real).bind(*args, **kwargs)


def _installed(module: str, fn: str):
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == module.split(".")[0]}
    try:
        mod = pytest.importorskip(module)
        return getattr(mod, fn)
    finally:
        sys.modules.update(saved)
