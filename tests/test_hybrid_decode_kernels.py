"""A hybrid decode step's GPU kernels' wiring (graphcp.model.hybrid.step_kernels), on the CPU
through fakes that model what the libraries accept: fla-core's
``fused_recurrent_gated_delta_rule`` (``[B, T, H, K]`` inputs, ``g`` and ``beta`` by keyword,
a float32 ``initial_state`` ``[B, H, K, V]`` it does not write, a new final state) and
causal-conv1d's ``causal_conv1d_update`` (``x`` ``[B, C]``, a ``conv_state`` ``[B, C,
state_len]`` of x's dtype that it shifts in place, the library's reference semantics).
The engine's steps with both at CP 2 (sharded eagerly, layer-split on the decode graphs)
equal the torch path, and every call binds to the installed functions' signatures where
the libraries' Python interfaces are installed (their kernels never run here).
"""

from __future__ import annotations

import importlib
import importlib.util
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
from graphcp.model.hybrid import step_kernels

CALLS: dict[str, list] = {"fla": [], "conv": []}


def fake_fused_recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                         output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kw):
    """fla's contract, token by token: ``S = S exp(g) + k (beta (v - S^T k))^T``, ``o = scale S^T q``."""
    CALLS["fla"].append(((q, k, v), dict(g=g, beta=beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, **kw)))
    B, T, H, K = k.shape
    assert gk is None and gv is None and cu_seqlens is None and not use_qk_l2norm_in_kernel
    assert q.shape == k.shape and v.shape[:3] == (B, T, H) and g.shape == beta.shape == (B, T, H)
    assert initial_state.shape == (B, H, K, v.shape[-1]) and initial_state.dtype == torch.float32
    assert all(x.is_contiguous() for x in (q, k, v, g, beta, initial_state)) and K <= 256
    state, out = initial_state.clone(), torch.empty_like(v)  # (the initial state is not written)
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        delta = (v[:, t] - (state * kt[..., None]).sum(-2)) * beta[:, t][..., None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = scale * (state * q[:, t][..., None]).sum(-2)
    return out, state if output_final_state else None


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                              conv_state_indices=None):
    """causal-conv1d's contract (its causal_conv1d_update_ref): the state shifted in place."""
    CALLS["conv"].append(((x, conv_state, weight, bias), dict(activation=activation)))
    B, C = x.shape
    W, L = weight.shape[1], conv_state.shape[-1]
    assert cache_seqlens is None and conv_state_indices is None and activation == "silu" and 2 <= W <= 4
    assert conv_state.shape == (B, C, L) and L >= W - 1 and conv_state.dtype == x.dtype
    full = torch.cat([conv_state, x[..., None]], dim=-1).to(weight.dtype)
    conv_state.copy_(full[:, :, -L:])
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=C)[:, :, -1]
    return F.silu(out).to(x.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    """The fake modules installed, and select_step_kernels giving the CUDA choice on this CPU."""
    fla, ops, gdr = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))
    gdr.fused_recurrent_gated_delta_rule = fake_fused_recurrent
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_update = fake_causal_conv1d_update
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, mod)
    chosen = step_kernels.StepKernels("fla+causal-conv1d", step_kernels.fla_step_rule(),
                                      step_kernels.causal_conv1d_step())
    monkeypatch.setattr(step_kernels, "select_step_kernels", lambda device: chosen)
    for calls in CALLS.values():
        calls.clear()
    return chosen


def _greedy(eng: PrefillEngine, steps: int = 4) -> tuple[list[torch.Tensor], set]:
    rng = np.random.default_rng(1)
    out = eng.prefill([Request(rng.integers(0, 512, n)) for n in (3, 40)])
    handles, tok, logits = out.handles, out.last_logits.argmax(-1), []
    for _ in range(steps):
        o = eng.decode(handles, tok)
        handles, tok = o.handles, o.logits.argmax(-1)
        logits.append(o.logits)
    return logits, {s["linear_kernels"] for s in eng.stats()["decode_steps"]}


def _job(group, folder):
    out = {}
    for mode, graph in (("sharded", "off"), ("layer-split", "breakable")):
        rt = RuntimeConfig(kv_tokens=1024, kv_cache=mode, graph=graph, page_size=16)
        out[mode] = _greedy(PrefillEngine(folder, rt, group))
    return out


def test_the_cuda_step_kernels_wiring_equals_the_torch_path(hf_model_dir, fake_kernels):
    folder = hf_model_dir("qwen3_5_text")
    got = launch(_job, 2, folder)[0]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_kernels, "select_step_kernels", lambda device: step_kernels.TORCH_STEP)
        want = launch(_job, 2, folder)[0]
    for mode in got:
        assert got[mode][1] == {"fla+causal-conv1d"} and want[mode][1] == {"torch"}, mode
        for a, b in zip(got[mode][0], want[mode][0], strict=True):
            assert rel_err(a, b) <= 1e-5, mode


def test_the_step_calls_bind_to_the_installed_signatures(hf_model_dir, fake_kernels):
    """Each recorded call bound to the real function (skipped where a library's Python
    interface is not installed; causal-conv1d's is read without its CUDA extension)."""
    eng = PrefillEngine(hf_model_dir("qwen3_5_text"), RuntimeConfig(kv_tokens=1024))
    _greedy(eng, 1)
    assert CALLS["fla"] and CALLS["conv"]
    for lib, module, fn in (("fla", "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                            ("conv", "causal_conv1d", "causal_conv1d_update")):
        real = _installed(module, fn)
        for args, kwargs in CALLS[lib]:
            inspect.signature(real).bind(*args, **kwargs)


def _installed(module: str, fn: str):
    root = module.split(".")[0]
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == root}
    try:
        if importlib.util.find_spec(root) is None:
            pytest.skip(f"{root} is not installed")
        with pytest.MonkeyPatch.context() as m:  # (causal-conv1d's compiled extension: not needed to read it)
            if root == "causal_conv1d" and importlib.util.find_spec("causal_conv1d_cuda") is None:
                m.setitem(sys.modules, "causal_conv1d_cuda", types.ModuleType("causal_conv1d_cuda"))
            try:
                return getattr(importlib.import_module(module), fn)
            except ImportError as e:
                pytest.skip(f"{module} does not import here: {e}")
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == root]:
            del sys.modules[k]
        sys.modules.update(saved)
