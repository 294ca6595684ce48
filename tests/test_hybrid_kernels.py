"""The hybrid's GPU kernels' wiring (graphcp.model.hybrid.kernels), on the CPU through
fakes that model the libraries' contracts (fla-core 0.6.0, causal-conv1d 1.7.0):

- fla's ``chunk_gated_delta_rule``: one varlen batch (``[1, n, H, K]`` q/k, ``[1, n, HV,
  V]`` v, value head ``i`` on key head ``i // (HV / H)``), ``cu_seqlens`` int64 and its
  host copy, the chunk indices, q/k normalised in the kernel and rounded to their dtype
  (``l2norm_fwd``), a float32 state whatever the inputs' dtype, ``o`` in q's dtype; a
  token-by-token recurrence, not graphcp's chunked code; q/k/v of one half-precision
  dtype (what FlashQLA's verifier takes; float32 would fall to TF32 dots);
- causal-conv1d's ``causal_conv1d_fn``: channel-last ``x`` with channels and strides
  multiples of 8, ``seq_idx`` int32 (no ``initial_states`` beside it), float32 sums and
  the SiLU, rounded to x's dtype.

A bfloat16 model runs fla on bfloat16 q/k/v with a float32 state and stays within the
suite's bound of transformers at CP 1 and at CP 2 on breakable graphs; a float32 model runs the torch rule (fla is
not called) and causal-conv1d's convolution, equal to the torch path; every call binds to
the installed functions' signatures where they import; a library that is installed but
raises at import leaves the engine on the torch kernels with one note.
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
from graphcp.runtime.capture.buckets import BucketSet

CALLS: dict[str, list] = {"fla": [], "conv": []}
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def fake_fla_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, **kw):
    """fla's contract, token by token: ``S = S exp(g) + k (beta (v - k^T S))``, ``o = scale q^T S``."""
    CALLS["fla"].append(((q, k, v, g, beta), dict(scale=scale, initial_state=initial_state,
                                                  output_final_state=output_final_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                                  chunk_indices=chunk_indices, **kw)))
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    assert q.shape == k.shape and v.shape[:2] == (B, T) and HV % H == 0 and K <= 256
    assert g.shape == beta.shape == (B, T, HV) and g.dtype == torch.float32
    # FlashQLA's verifier (backends/flash_qla.py) takes half-precision q/k/v of one dtype only;
    # float32 would run the Triton path's TF32 dots (module doc): a model's call never sends it
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16), (q.dtype, k.dtype, v.dtype)
    assert B == 1 and cu_seqlens.dtype == cu_seqlens_cpu.dtype == torch.int64 and cu_seqlens_cpu.device.type == "cpu"
    cu = cu_seqlens_cpu.tolist()
    assert cu_seqlens.tolist() == cu and cu[-1] == T and initial_state.shape == (len(cu) - 1, HV, K, V)
    assert initial_state.dtype == torch.float32
    want = [(b, i) for b in range(len(cu) - 1) for i in range(-(-(cu[b + 1] - cu[b]) // 64))]
    assert chunk_indices.tolist() == [list(x) for x in want]
    if use_qk_l2norm_in_kernel:  # fla's l2norm_fwd: float32 norm, the result in the input's dtype
        q, k = ((x.float() * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype) for x in (q, k))
    head = torch.arange(HV) // (HV // H)
    qf, kf, vf, bf = q[0].float()[:, head], k[0].float()[:, head], v[0].float(), beta[0].float()
    out, finals = torch.empty(T, HV, V), []
    for n in range(len(cu) - 1):
        state = initial_state[n].clone()
        for t in range(cu[n], cu[n + 1]):
            state = state * g[0, t].exp()[:, None, None]
            delta = (vf[t] - (state * kf[t][..., None]).sum(-2)) * bf[t][:, None]
            state = state + kf[t][..., None] * delta[:, None, :]
            out[t] = scale * (state * qf[t][..., None]).sum(-2)
        finals.append(state)
    return out[None].to(q.dtype), torch.stack(finals) if output_final_state else None


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    """causal-conv1d's contract with ``seq_idx`` (its causal_conv1d_ref; float32 sums and SiLU)."""
    CALLS["conv"].append(((x, weight, bias, seq_idx, initial_states), dict(activation=activation)))
    assert x.stride(1) == 1 and activation == "silu" and initial_states is None and weight.dtype == x.dtype
    # causal_conv1d.cpp's checks on a channel-last x (its TORCH_CHECKs refuse the call otherwise)
    assert x.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0 and 2 <= weight.shape[1] <= 4
    assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (x.shape[0], x.shape[2])
    width = weight.shape[1]
    full = F.pad(x.float(), (width - 1, 0))
    seqs = torch.cat([seq_idx.new_full((x.shape[0], width - 1), -1), seq_idx], dim=-1)
    same = seqs.unfold(-1, width, 1) == seq_idx.unsqueeze(-1)  # [B, L, width]
    out = (full.unfold(-1, width, 1) * same.unsqueeze(1) * weight.float().view(1, -1, 1, width)).sum(-1)
    return F.silu(out).to(x.dtype)


def _install(monkeypatch, fla: bool = True, conv: bool = True) -> None:
    """The fake modules in sys.modules; select_kernels giving the CUDA choice on this CPU."""
    if fla:
        mods = [types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule")]
        mods[2].chunk_gated_delta_rule = fake_fla_rule
        for mod in mods:
            monkeypatch.setitem(sys.modules, mod.__name__, mod)
    if conv:
        mod = types.ModuleType("causal_conv1d")
        mod.causal_conv1d_fn = fake_causal_conv1d_fn
        monkeypatch.setitem(sys.modules, "causal_conv1d", mod)
    monkeypatch.setattr(kernels, "_installed", lambda module: module in sys.modules)
    monkeypatch.setattr(kernels, "select_kernels", lambda device: kernels.choose_kernels())
    kernels.load.cache_clear()
    for calls in CALLS.values():
        calls.clear()


@pytest.fixture
def fake_kernels(monkeypatch):
    _install(monkeypatch)
    yield
    kernels.load.cache_clear()


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("qwen3_5_text")


def _tokens():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 512, n) for n in (3, 70, 150)]


def _job(group, folder, dtype, graph="off"):
    """The three requests in one batch, then the 150-token one as a 30-token prefix and its
    continuation: every token's logits, the kernels' name and the dtypes fla saw (``graph``:
    breakable graphs, every forward asserted to replay)."""
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, dtype=dtype, graph=graph), group,
                        BucketSet((64, 256), padding_factor=64.0))
    toks = _tokens()
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    head = eng.prefill([Request(toks[2][:30])], all_logits=True)
    tail = eng.prefill([Request(toks[2][30:], head.handles[0])], all_logits=True)
    assert {o.info.path for o in (one, head, tail)} == {"eager" if graph == "off" else "graph"}
    seen = {(str(a[0].dtype), str(a[1].dtype), str(a[2].dtype), str(kw["initial_state"].dtype))
            for a, kw in CALLS["fla"]}
    logits = [x.float().clone() for x in one.logits] + [torch.cat([head.logits[0], tail.logits[0]]).float()]
    return logits, one.info.stats["linear_kernels"], seen, len(CALLS["conv"])


def _reference(hf_model, folder, dtype):
    model = hf_model(folder, dtype)
    toks = _tokens()
    with torch.no_grad():
        out = [model(torch.tensor(t)[None]).logits[0].float() for t in toks]
    return out + [out[2]]


@pytest.mark.parametrize("cp", [1, 2])
def test_a_bfloat16_model_runs_fla_on_bfloat16_with_a_float32_state(folder, hf_model, fake_kernels, cp):
    """fla sees bfloat16 q/k/v and a float32 state. Against the float32 model (transformers),
    the batch's logits are as close as the bfloat16 torch path's (within 1.25x its error:
    another kernel's bfloat16 rounding moves this tiny model's logits by about the suite's
    2e-2 bound itself, so the bound is relative to the torch path's, in the same run)."""
    graph = "off" if cp == 1 else "breakable"  # at CP 2 the linear layers run in the graphs' breaks
    got, name, seen, convs = launch(_job, cp, folder, "bfloat16", graph)[0]
    assert name == "fla+causal-conv1d" and convs > 0
    assert seen == {("torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.float32")}, seen
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "select_kernels", lambda device: kernels.TORCH)
        want, _, _, _ = launch(_job, cp, folder, "bfloat16", graph)[0]
    a, b, r = (torch.cat(x) for x in (got, want, _reference(hf_model, folder, "float32")))
    assert rel_err(a, r) <= 1.25 * rel_err(b, r) and rel_err(a, b) <= 2 * TOL["bfloat16"], (rel_err(a, r),
                                                                                           rel_err(b, r))


def test_a_float32_model_runs_the_torch_rule_and_equals_the_torch_path(folder, hf_model, fake_kernels):
    got, name, seen, convs = launch(_job, 2, folder, "float32")[0]
    assert name == "causal-conv1d" and seen == set() and convs > 0  # fla's TF32 dots are not taken
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "select_kernels", lambda device: kernels.TORCH)
        want, torch_name, _, _ = launch(_job, 2, folder, "float32")[0]
    assert torch_name == "torch"
    ref = _reference(hf_model, folder, "float32")
    for a, b, r in zip(got, want, ref, strict=True):
        assert rel_err(a, b) <= 1e-5 and rel_err(a, r) <= TOL["float32"]


def test_the_calls_bind_to_the_installed_signatures(folder, fake_kernels):
    """Each recorded call bound to the real function (skipped where a library does not import)."""
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, dtype="bfloat16"))
    eng.prefill([Request(t) for t in _tokens()])
    assert CALLS["fla"] and CALLS["conv"]
    for lib, module, fn in (("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                            ("conv", "causal_conv1d", "causal_conv1d_fn")):
        real = _installed(module, fn)
        if real is None:
            continue
        sig = inspect.signature(real)
        named = {n for n, p in sig.parameters.items() if p.kind is not p.VAR_KEYWORD}
        for args, kwargs in CALLS[lib]:
            sig.bind(*args, **kwargs)
            assert set(kwargs) <= named, set(kwargs) - named  # none swallowed by a **kwargs
    if _installed("fla.ops.gated_delta_rule", "chunk_gated_delta_rule") is None and \
            _installed("causal_conv1d", "causal_conv1d_fn") is None:
        pytest.skip("neither fla-core nor causal-conv1d imports here")


def _installed(module: str, fn: str):
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == module.split(".")[0]}
    try:
        return getattr(__import__(module, fromlist=[fn]), fn)
    except Exception:  # noqa: BLE001 - not installed, or does not import
        return None
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == module.split(".")[0]]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_a_broken_library_falls_back_with_one_note(folder, monkeypatch, tmp_path, capsys):
    """causal-conv1d installed but built for another torch: its import raises ImportError
    (an undefined symbol). The engine is built on fla and the torch convolution, one note
    on stderr says why (once, however many engines), and its results are the torch path's."""
    pkg = tmp_path / "causal_conv1d"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise ImportError("/site-packages/causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so: '
                                     'undefined symbol: _ZN3c104cuda9SetDeviceEa")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    _install(monkeypatch, conv=False)
    monkeypatch.setattr(kernels, "_installed", lambda module: module == "fla" or module == "causal_conv1d")
    engines = [PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, dtype="bfloat16")) for _ in range(2)]
    chosen = kernels.choose_kernels()
    assert (chosen.rule.name, chosen.conv.name) == ("fla", "torch") and len(chosen.notes) == 1
    notes = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    assert len(notes) == 1 and "causal-conv1d" in notes[0] and "ImportError" in notes[0], notes
    assert "undefined symbol" in notes[0] and "the convolution runs the torch reference" in notes[0]
    out = engines[1].prefill([Request(t) for t in _tokens()])
    assert out.info.stats["linear_kernels"] == "fla"
    kernels.load.cache_clear()


def test_causal_conv1d_takes_widths_it_accepts_and_the_torch_convolution_the_others(monkeypatch):
    """causal-conv1d refuses a channel-last x whose channels are not a multiple of 8: such
    a width runs the torch convolution (no call); 16 channels run the kernel. Both equal
    the torch convolution over blocks of 0 to 70 rows with their halos (bfloat16)."""
    from graphcp.model.hybrid.gdn import conv_rows
    from graphcp.model.hybrid.varlen import ConvRows
    from graphcp.model.hybrid.varlen import conv_rows as conv_layout

    _install(monkeypatch)
    conv = kernels.causal_conv1d_conv()
    g = torch.Generator().manual_seed(5)
    cu, K = np.array([0, 70, 70, 71, 100]), 4
    nb = len(cu) - 1
    halo = np.arange(nb * (K - 1)).reshape(nb, K - 1)
    for channels, calls in ((12, 0), (16, 1)):
        rows = ConvRows(*(torch.from_numpy(a) for a in conv_layout(cu, halo, nb * (K - 1))), K)
        rows.seq = rows.seq.to(torch.int32)
        source = torch.randn(nb * (K - 1) + 100, channels, generator=g).to(torch.bfloat16)
        weight = torch.randn(channels, K, generator=g).to(torch.bfloat16)
        CALLS["conv"].clear()
        got = conv.fn(source, rows, weight)
        assert len(CALLS["conv"]) == calls
        assert rel_err(got, conv_rows(source, rows, weight)) <= 1e-2, channels
    kernels.load.cache_clear()


def test_the_gpu_checks_hybrid_rows_judge_the_kernels(monkeypatch):
    """``graphcp gpu-check``'s hybrid part (graphcp.gpucheck.hybrid) on the varlen batch, its
    kernels through the fakes: the float32 row names causal-conv1d and equals the torch
    kernels; the bfloat16 row names fla and causal-conv1d and passes; an fla call whose
    scale is wrong (1.0, as for q scaled beforehand) fails the bfloat16 row."""
    from dataclasses import replace

    from graphcp.cli.main import build_parser
    from graphcp.gpucheck import hybrid
    from graphcp.gpucheck.settings import settings_from_args

    _install(monkeypatch)
    st = replace(settings_from_args(build_parser().parse_args(["gpu-check", "--dry-run"])), hybrid_batch=(70, 5, 5))
    reference: dict = {}
    rows = []
    for dtype in ("float32", "bfloat16"):
        row = {"dtype": dtype, "status": "pass"}
        hybrid._judge_kernels(hybrid._engine(st, dtype), st, row, reference)
        rows.append(row)
    f32, bf16 = rows
    assert f32["linear_kernels"] == "causal-conv1d" and f32["status"] == "pass" and f32["kernels_rel_diff_vs_torch"] <= 1e-5
    assert bf16["linear_kernels"] == "fla+causal-conv1d" and bf16["status"] == "pass", bf16
    assert 0 < bf16["kernels_rel_diff_vs_float32"] <= bf16["kernels_bound"] == 1.25 * bf16["torch_rel_diff_vs_float32"]

    monkeypatch.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule",
                        lambda *a, **kw: fake_fla_rule(*a, **{**kw, "scale": 1.0}))
    kernels.load.cache_clear()
    row = {"dtype": "bfloat16", "status": "pass"}
    hybrid._judge_kernels(hybrid._engine(st, "bfloat16"), st, row, reference)
    assert row["status"] == "fail" and row["kernels_rel_diff_vs_float32"] > row["kernels_bound"], row
    assert row["error"].startswith("fla+causal-conv1d is ")
    kernels.load.cache_clear()
