"""RuntimeConfig.moe and the graph modes an MoE model refuses, the ``default-moe``
preset (a small Qwen3-MoE written in the Hub format, which transformers loads too),
and random MoE checkpoints of both families in their Hub names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.loader import load_model
from graphcp.model.presets import ensure_preset, ensure_random_model


def test_runtime_moe_is_checked():
    assert RuntimeConfig().moe == "ep"
    with pytest.raises(ConfigError, match=r"RuntimeConfig\.moe must be one of ep, tp, got 'dp'"):
        RuntimeConfig(moe="dp")


def test_tp_in_cuda_graphs_needs_the_sync_free_grouped_kernel(hf_model_dir, monkeypatch):
    eng = PrefillEngine(hf_model_dir("qwen3_moe"), RuntimeConfig(moe="tp", kv_tokens=256))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    problem = eng.parts.model.capture_problem(torch.device("cuda"), full=False)
    assert "moe='tp' keeps the experts inside the captured graphs" in problem and "float32" in problem
    assert eng.parts.model.capture_problem(torch.device("cpu"), full=True) is None  # tp is static-shaped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_experts_held_out_of_graphs_run_in_the_attention_break(hf_model_dir, monkeypatch, dtype):
    """Where a captured torch._grouped_mm is not trusted (CUDA until the GPU check's
    moe_graph passes; pytorch issue 169970), breakable graphs keep the tp layout's experts
    out of the captured segments: they run in the attention break, still one break a
    layer, and the logits equal the eager forward's. Forced here on the CPU trace backend;
    a full graph is refused. (Before, moe='tp' with graphs on CUDA had no such path.)"""
    from graphcp.model import llama
    from graphcp.runtime.capture.buckets import BucketSet

    monkeypatch.setattr(llama, "grouped_mm_capturable", lambda device, dt, *a, **k: False)
    folder = hf_model_dir("qwen3_moe")
    with pytest.raises(ConfigError, match=r"graph='full' would capture the experts of moe='tp'.*169970"):
        PrefillEngine(folder, RuntimeConfig(graph="full", attention="triton", moe="tp", kv_tokens=256))
    eng = PrefillEngine(folder, RuntimeConfig(graph="breakable", moe="tp", kv_tokens=1024, dtype=dtype), None,
                        BucketSet((32,), padding_factor=64.0))
    moe_layers = [layer for layer in eng.parts.model.layers if layer.mlp.__class__.__name__ == "SparseMoeBlock"]
    assert moe_layers and all(layer.exchanges for layer in moe_layers)
    rng = np.random.default_rng(3)
    toks = [rng.integers(0, 512, n) for n in (13, 7)]
    out = {}
    for path in ("graph", "eager"):
        o = eng.prefill([Request(t) for t in toks], all_logits=True, force_eager=path == "eager")
        assert o.info.path == path
        out[path] = o.logits
        for h in o.handles:
            eng.release(h)
    assert len(eng.parts.runner.graphs[32].graph.breaks) == eng.cfg.num_layers  # the experts joined the attention breaks
    tol = 1e-5 if dtype == "float32" else 2e-2
    for g, e in zip(out["graph"], out["eager"]):
        assert rel_err(g, e) <= tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_experts_without_the_sync_free_kernel_still_take_breakable_graphs(hf_model_dir, monkeypatch, dtype):
    """Where torch._grouped_mm is not sync-free (float32 on CUDA, bfloat16 before sm90) the
    experts held out of the graphs run in the eager break, where a host sync is harmless:
    breakable graphs are built (they were refused, the check ran before the experts moved)
    and equal eager; a full graph, which would capture them, is still refused."""
    from graphcp.model import llama
    from graphcp.runtime.capture.buckets import BucketSet

    monkeypatch.setattr(llama, "grouped_mm_capturable", lambda device, dt, *a, **k: False)
    monkeypatch.setattr(llama, "grouped_mm_sync_free", lambda device, dt, *a, **k: False)
    folder = hf_model_dir("qwen3_moe")
    with pytest.raises(ConfigError, match=r"needs torch._grouped_mm's sync-free kernel"):
        PrefillEngine(folder, RuntimeConfig(graph="full", attention="triton", moe="tp", kv_tokens=256, dtype=dtype))
    eng = PrefillEngine(folder, RuntimeConfig(graph="breakable", moe="tp", kv_tokens=512, dtype=dtype), None,
                        BucketSet((32,), padding_factor=64.0))
    toks = [np.random.default_rng(5).integers(0, 512, n) for n in (11, 6)]
    out = {}
    for path in ("graph", "eager"):
        o = eng.prefill([Request(t) for t in toks], all_logits=True, force_eager=path == "eager")
        assert o.info.path == path
        out[path] = o.logits
    assert len(eng.parts.runner.graphs[32].graph.breaks) == eng.cfg.num_layers
    for g, e in zip(out["graph"], out["eager"]):
        assert rel_err(g, e) <= (1e-5 if dtype == "float32" else 2e-2)


def test_default_moe_preset_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = ensure_preset("default-moe", root=tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    tokens = np.random.default_rng(0).integers(0, 8192, 70)
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=512))
    assert eng.cfg.moe.layers == (1, 2, 3)  # layer 0 dense (mlp_only_layers)
    got = eng.prefill([Request(tokens)], all_logits=True).logits[0]
    with torch.inference_mode():
        want = ref(input_ids=torch.from_numpy(tokens).view(1, -1)).logits[0]
    assert rel_err(got, want) < 1e-4


def test_random_moe_checkpoints_use_each_familys_hub_names(tmp_path):
    """The random-checkpoint writer (presets, the GPU check's cut-down models) names
    experts as the family's Hub checkpoints do, so the loader takes them as written."""
    from conftest import hf_config

    for family, module in (("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")):
        folder = ensure_random_model(family, hf_config(family, False).to_dict(), root=tmp_path)
        read: list[str] = []
        load_model(folder, torch.float32, rank=1, tp_size=2, on_tensor=read.append, moe="ep")
        assert f"model.layers.0.{module}.experts.7.{'w2' if family == 'mixtral' else 'down_proj'}.weight" in read
