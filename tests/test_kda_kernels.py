"""KDA's GPU kernels' wiring (graphcp.model.kimi_linear.kernels), on the CPU through fakes
that model fla-core 0.6's contracts: ``fla.ops.kda.chunk_kda`` and ``fused_recurrent_kda``
(``[B, T, H, K]`` q/k/v, per-channel log decays ``g`` ``[B, T, H, K]``, a float32
``initial_state`` ``[B, H, K, V]`` (fla asserts it), a token-by-token recurrence, not
graphcp's chunked code; the output in v's dtype, the final state float32)
and causal-conv1d's ``causal_conv1d_fn`` (tests/test_hybrid_kernels.py's fake). The
engine with them at CP 2 equals the torch reference path (float32 1e-5, bfloat16 2e-2),
the one-token step equals the reference step, and every call binds to the installed
functions' signatures where the libraries import (their kernels never run here).
"""

from __future__ import annotations

import inspect
import sys
import types

import numpy as np
import pytest
import torch
from helpers import rel_err
from test_hybrid_kernels import _installed, fake_causal_conv1d_fn

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.kimi_linear import kernels
from graphcp.model.kimi_linear.kda import query_key, recurrent_kda

CALLS: dict[str, list] = {"chunk": [], "step": []}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _recurrence(q, k, v, g, beta, scale, initial_state):
    """fla's KDA contract, token by token, in float32: ``S = S exp(g)`` per key channel,
    ``S += k (beta (v - k^T S))``, ``o = scale q^T S``; o in v's dtype."""
    B, T, H, K = k.shape
    assert q.shape == k.shape and v.shape[:3] == (B, T, H) and g.shape == (B, T, H, K) and beta.shape == (B, T, H)
    assert initial_state.dtype == torch.float32 and initial_state.shape == (B, H, K, v.shape[-1]) and K <= 256
    assert all(x.is_contiguous() for x in (q, k, v, g, beta))
    state, out = initial_state.clone(), torch.empty(v.shape, dtype=torch.float32)
    for t in range(T):
        state = state * g[:, t].float().exp()[..., None]
        kt = k[:, t].float()
        delta = (v[:, t].float() - (state * kt[..., None]).sum(-2)) * beta[:, t].float()[..., None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = scale * (state * q[:, t].float()[..., None]).sum(-2)
    return out.to(v.dtype), state


def fake_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    CALLS["chunk"].append(((q, k, v, g, beta), dict(scale=scale, initial_state=initial_state,
                                                    output_final_state=output_final_state, **kw)))
    o, state = _recurrence(q, k, v, g, beta, scale, initial_state)
    return o, state if output_final_state else None


def fake_fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    CALLS["step"].append(((q, k, v, g, beta), dict(scale=scale, initial_state=initial_state,
                                                   output_final_state=output_final_state, **kw)))
    o, state = _recurrence(q, k, v, g, beta, scale, initial_state)
    return o, state if output_final_state else None


@pytest.fixture
def fake_kernels(monkeypatch):
    """The fake modules installed, and select_kernels giving the CUDA choice on this CPU."""
    fla, ops, kda = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.kda"))
    kda.chunk_kda, kda.fused_recurrent_kda = fake_chunk_kda, fake_fused_recurrent_kda
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = fake_causal_conv1d_fn
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.kda", kda), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, mod)
    real = kernels.select_kernels
    monkeypatch.setattr(kernels, "select_kernels", lambda device: real(torch.device("cuda")))
    for calls in CALLS.values():
        calls.clear()


def _job(group, folder, dtype):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, dtype=dtype), group)
    rng = np.random.default_rng(1)
    toks = [rng.integers(0, 512, n) for n in (3, 70)]
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    head = eng.prefill([Request(toks[1][:30])])
    tail = eng.prefill([Request(toks[1][30:], head.handles[0])], all_logits=True)
    return [x.clone() for x in one.logits] + [tail.logits[0].clone()], one.info.stats["linear_kernels"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cuda_kernels_wiring_equals_the_torch_path(hf_model_dir, fake_kernels, dtype):
    folder = hf_model_dir("kimi_linear", num_experts_per_tok=8, n_group=1)
    got, name = launch(_job, 2, folder, dtype)[0]
    assert name == "fla+causal-conv1d"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "select_kernels", lambda device: kernels.TORCH)
        want, torch_name = launch(_job, 2, folder, dtype)[0]
    assert torch_name == "torch"
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= TOL[dtype], dtype


def test_the_step_equals_the_reference_step(fake_kernels):
    g = torch.Generator().manual_seed(0)
    B, H, d = 3, 2, 16
    q, k = query_key(torch.randn(B, H, d, generator=g), torch.randn(B, H, d, generator=g))
    v, decay = torch.randn(B, H, d, generator=g), -0.1 * torch.rand(B, H, d, generator=g)
    beta, state = torch.rand(B, H, generator=g), torch.randn(B, H, d, d, generator=g)
    chosen = kernels.select_kernels(torch.device("cpu"))
    assert chosen.name == "fla+causal-conv1d"
    got = chosen.step(q, k, v, decay, beta, state)
    want = recurrent_kda(q, k, v, decay, beta, state)
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(got, want)) and CALLS["step"]


def test_the_calls_bind_to_the_installed_signatures(hf_model_dir, fake_kernels):
    """Each recorded call bound to the real function (skipped where a library does not import)."""
    eng = PrefillEngine(hf_model_dir("kimi_linear"), RuntimeConfig(kv_tokens=1024))
    eng.prefill([Request([1, 2, 3, 4, 5])])
    step = kernels.select_kernels(torch.device("cpu")).step
    step(*(torch.zeros(1, 2, 4),) * 3, torch.zeros(1, 2, 4), torch.zeros(1, 2), torch.zeros(1, 2, 4, 4))
    assert CALLS["chunk"] and CALLS["step"]
    for lib, module, fn in (("chunk", "fla.ops.kda", "chunk_kda"), ("step", "fla.ops.kda", "fused_recurrent_kda")):
        real = _installed(module, fn)
        for args, kwargs in CALLS[lib]:
            inspect.signature(real).bind(*args, **kwargs)
