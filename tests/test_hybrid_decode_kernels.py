"""A hybrid decode step's GPU kernels' wiring (graphcp.model.hybrid.step_kernels), on the CPU
through fakes that model what the libraries accept: fla-core's
``fused_recurrent_gated_delta_rule`` (``[B, T, H, K]`` q/k and ``[B, T, HV, V]`` v in the
model's dtype, normalised in the kernel, ``g`` and ``beta`` by keyword, a float32
``initial_state`` it does not write, a new final state) and
causal-conv1d's ``causal_conv1d_update`` (``x`` ``[B, C]`` or ``[B, C, seqlen]``, a
``conv_state`` ``[B, C, state_len]`` of x's dtype that it shifts in place, the library's
reference semantics).
The engine's steps with both at CP 2 (sharded eagerly, layer-split on the decode graphs)
equal the torch path, a bfloat16 model's calls see its dtype and a float32 state, and every call binds to the installed functions' signatures where
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
from graphcp.model.hybrid import kernels, step_kernels

CALLS: dict[str, list] = {"fla": [], "conv": []}


def fake_fused_recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                         output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kw):
    """fla's contract, token by token in float32: q and k l2-normalised in the kernel (when
    asked), value head ``i`` on key head ``i // (HV / H)``, ``S = S exp(g) + k (beta (v -
    S^T k))^T``, ``o = scale S^T q`` in v's dtype; the initial state is not written."""
    CALLS["fla"].append(((q, k, v), dict(g=g, beta=beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)))
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    assert gk is None and gv is None and cu_seqlens is None and HV % H == 0 and K <= 256
    assert q.shape == k.shape and v.shape[:2] == (B, T) and g.shape == beta.shape == (B, T, HV)
    assert q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == torch.float32
    assert initial_state.shape == (B, HV, K, V) and initial_state.dtype == torch.float32
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (qf, kf))
    qf, kf = (x.repeat_interleave(HV // H, dim=2) for x in (qf, kf))
    state, out = initial_state.clone(), torch.empty_like(v)
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        kt = kf[:, t]
        delta = (v[:, t].float() - (state * kt[..., None]).sum(-2)) * beta[:, t].float()[..., None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = (scale * (state * qf[:, t][..., None]).sum(-2)).to(v.dtype)
    return out, state if output_final_state else None


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                              conv_state_indices=None):
    """causal-conv1d's contract (its causal_conv1d_update_ref): ``x`` ``[B, C]`` or ``[B, C,
    seqlen]`` (out the same shape), the state shifted in place."""
    CALLS["conv"].append(((x, conv_state, weight, bias), dict(activation=activation)))
    rows = x if x.dim() == 3 else x[..., None]
    B, C, T = rows.shape
    W, L = weight.shape[1], conv_state.shape[-1]
    assert cache_seqlens is None and conv_state_indices is None and activation == "silu" and 2 <= W <= 4
    assert conv_state.shape == (B, C, L) and L >= W - 1 and conv_state.dtype == x.dtype and x.is_contiguous()
    full = torch.cat([conv_state, rows], dim=-1).to(weight.dtype)
    conv_state.copy_(full[:, :, -L:])
    out = F.silu(F.conv1d(full, weight.unsqueeze(1), bias, groups=C)[:, :, -T:]).to(x.dtype)
    return out if x.dim() == 3 else out[..., 0]


@pytest.fixture
def fake_modules(monkeypatch):
    """The fake modules installed."""
    fla, ops, gdr = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))
    gdr.fused_recurrent_gated_delta_rule = fake_fused_recurrent
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_update = fake_causal_conv1d_update
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, mod)
    for calls in CALLS.values():
        calls.clear()


@pytest.fixture
def fake_kernels(monkeypatch, fake_modules):
    """select_step_kernels giving the CUDA choice (the fakes) on this CPU."""
    chosen = step_kernels.StepKernels("fla+causal-conv1d", step_kernels.fla_step_rule(),
                                      step_kernels.causal_conv1d_step(), step_kernels.causal_conv1d_rows())
    monkeypatch.setattr(step_kernels, "select_step_kernels", lambda device: chosen)
    return chosen


@pytest.mark.parametrize("fla,conv,name", [(True, True, "fla+causal-conv1d"), (False, True, "causal-conv1d"),
                                           (True, False, "fla"), (False, False, "torch")])
def test_the_step_takes_each_library_the_prefills_choice_imports(monkeypatch, fake_modules, fla, conv, name):
    """On CUDA each library whose kernel the prefill's choice loads (a broken one is left
    out there, with its note); the torch reference on any other device."""
    ok = {"fla-core": fla, "causal-conv1d": conv}
    monkeypatch.setattr(kernels, "load", lambda lib: (object() if ok[lib] else None, None))
    got = step_kernels.select_step_kernels(torch.device("cuda"))
    assert got.name == name
    assert (got.rule is step_kernels.recurrent_step) != fla and (got.conv is step_kernels.conv_step) != conv
    assert (got.conv_rows is step_kernels.conv_rows_step) != conv
    assert step_kernels.select_step_kernels(torch.device("cpu")) is step_kernels.TORCH_STEP


def _greedy(eng: PrefillEngine, steps: int = 4) -> tuple[list[torch.Tensor], set]:
    rng = np.random.default_rng(1)
    out = eng.prefill([Request(rng.integers(0, 512, n)) for n in (3, 40)])
    handles, tok, logits = out.handles, out.last_logits.argmax(-1), []
    for _ in range(steps):
        o = eng.decode(handles, tok, logits=True)
        handles, tok = o.handles, o.logits.argmax(-1)
        logits.append(o.logits)
    return logits, {s["linear_kernels"] for s in eng.stats()["decode_steps"]}


def _job(group, folder):
    out = {}
    for mode, graph in (("sharded", "off"), ("layer-split", "breakable")):
        rt = RuntimeConfig(kv_tokens=1024, kv_cache=mode, graph=graph, page_size=16)
        out[mode] = _greedy(PrefillEngine(folder, rt, group))
    return out


def _torch_path(fn, *args):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_kernels, "select_step_kernels", lambda device: step_kernels.TORCH_STEP)
        return fn(*args)


def test_the_cuda_step_kernels_wiring_equals_the_torch_path(hf_model_dir, fake_kernels):
    folder = hf_model_dir("qwen3_5_text")
    got = launch(_job, 2, folder)[0]
    want = _torch_path(launch, _job, 2, folder)[0]
    for mode in got:
        assert got[mode][1] == {"fla+causal-conv1d"} and want[mode][1] == {"torch"}, mode
        for a, b in zip(got[mode][0], want[mode][0], strict=True):
            assert rel_err(a, b) <= 1e-5, mode


def test_a_bfloat16_step_gives_fla_the_models_dtype_and_a_float32_state(hf_model_dir, fake_kernels):
    """As transformers calls it: bfloat16 q/k/v and beta, float32 decays and state; the
    steps as close to the torch path as bfloat16 allows."""
    folder = hf_model_dir("qwen3_5_text", False, "bfloat16")

    def run():
        return _greedy(PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, dtype="bfloat16")))[0]

    got = run()
    (q, k, v), kw = CALLS["fla"][0]
    assert q.dtype == k.dtype == v.dtype == kw["beta"].dtype == torch.bfloat16
    assert kw["g"].dtype == kw["initial_state"].dtype == torch.float32 and kw["use_qk_l2norm_in_kernel"]
    x, state, _, _ = CALLS["conv"][0][0]
    assert x.dtype == state.dtype == torch.bfloat16
    for a, b in zip(got, _torch_path(run), strict=True):
        assert rel_err(a, b) <= 2e-2


def test_the_step_calls_bind_to_the_installed_signatures(hf_model_dir, fake_kernels):
    """Each recorded call bound to the real function (skipped where a library's Python
    interface is not installed; causal-conv1d's is read without its CUDA extension)."""
    eng = PrefillEngine(hf_model_dir("qwen3_5_text"), RuntimeConfig(kv_tokens=1024))
    _greedy(eng, 1)
    eng.decode(eng.prefill([Request([1, 2, 3])]).handles, [[4, 5]])  # a verify step's shape: 2 rows a request
    assert CALLS["fla"] and CALLS["conv"] and any(args[0].dim() == 3 for args, _ in CALLS["conv"])
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
