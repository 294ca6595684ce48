"""What an EAGLE-3 draft adds to a CP prefill, and what its aligned inputs save.

Run: ``pytest benchmarks/bench_eagle3.py --benchmark-only``.

At CP 2 on the default model (4 layers, hidden 256), one 2048-token request is
prefilled eagerly without a draft and with one (a seeded EAGLE-3 checkpoint of the
default model's shape, draft vocabulary 2048, written to a temporary folder). Inside
the ranks each forward is timed (median of ``REPEATS``); the benchmark times the whole
launch. ``extra_info``: the medians, the draft phase's bytes per rank as the stats count
them (hidden states received for its inputs: 0; its K/V exchange), and what gathering
the draft's inputs and re-sharding them would have received per rank instead:
``(C - 1) / C`` of ``3 x hidden x tokens`` values (docs/speculative.md).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.presets import ensure_preset

TOKENS, REPEATS, CP, DRAFT_VOCAB = 2048, 5, 2, 2048


def _write_draft(folder: Path, target: dict) -> str:
    h, i, heads, kvh, d = (target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim"))
    g = torch.Generator().manual_seed(0)
    m = "midlayer."
    t = {"fc.weight": (3 * h, h), m + "self_attn.q_proj.weight": (2 * h, heads * d),
         m + "self_attn.k_proj.weight": (2 * h, kvh * d), m + "self_attn.v_proj.weight": (2 * h, kvh * d),
         m + "self_attn.o_proj.weight": (heads * d, h), m + "mlp.gate_proj.weight": (h, i),
         m + "mlp.up_proj.weight": (h, i), m + "mlp.down_proj.weight": (i, h), "lm_head.weight": (h, DRAFT_VOCAB)}
    tensors = {k: torch.randn(o, n, generator=g) * n ** -0.5 for k, (n, o) in t.items()}
    for k in (m + "input_layernorm.weight", m + "hidden_norm.weight", m + "post_attention_layernorm.weight",
              "norm.weight"):
        tensors[k] = torch.ones(h)
    ids = torch.arange(DRAFT_VOCAB) * (target["vocab_size"] // DRAFT_VOCAB)
    tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = torch.zeros(target["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True)
    config = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                     "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")}
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def _time(group, draft):
    eng = PrefillEngine("default", RuntimeConfig(kv_tokens=8192, draft=draft), group)
    ids = np.random.default_rng(0).integers(0, eng.cfg.vocab_size, TOKENS)
    times = []
    for _ in range(REPEATS + 1):  # the first warms up
        t0 = time.perf_counter()
        out = eng.prefill([Request(ids)])
        times.append(time.perf_counter() - t0)
        eng.release(out.handles[0])
    st = out.info.stats
    return {"median_s": float(np.median(times[1:])),
            "draft_hidden_bytes_received": st.get("draft_hidden_bytes_received"),
            "draft_kv_bytes_received": st.get("draft_kv_bytes_received"),
            "gather_reshard_bytes": (CP - 1) * (TOKENS // CP) * 3 * eng.cfg.hidden_size * eng.dtype.itemsize}


def test_draft_prefill_cost(benchmark):
    target = json.loads((ensure_preset("default") / "config.json").read_text())
    res = {}

    def run():
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            draft = _write_draft(Path(tmp) / "draft", target)
            for name, d in (("target", None), ("with_draft", draft)):
                res[name] = launch(_time, CP, d)[0]

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    assert res["with_draft"]["draft_hidden_bytes_received"] == 0
