"""A model family added from outside graphcp, as docs/structure.md's "Adding a model
family" says: a toy family defined in this file (a dense decoder whose checkpoint is
``ToyLMForCausalLM`` and names its tensors its own way) is registered and run through
``PrefillEngine`` (CP 1 and 2), ``graphcp prefill`` (the module named by
``$GRAPHCP_FAMILIES``), the KV export and greedy decoding on decode graphs (CP 1, and CP 2
over the sharded cache), with no change under ``graphcp/``. The
reference is transformers' Llama on the same weights, float32 and bfloat16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rel_err
from safetensors.torch import load_file, save_file

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.attention.base import AttentionSpec
from graphcp.attention.registry import make_attention, resolve
from graphcp.dist import launch
from graphcp.kv.spec import KVHeads
from graphcp.model.config import ConfigReader, decoder_config, read_head
from graphcp.model.dense.checkpoint import dense_tensors
from graphcp.model.family import ModelFamily, register_family
from graphcp.model.llama import DecoderModel
from graphcp.model.rope import rope_from_hf
from graphcp.pd.export import KVMeta

ROOT = Path(__file__).resolve().parents[1]
TOY_ARCH, TOY_TYPE = "ToyLMForCausalLM", "toylm"
#: the Hub's Llama names -> the toy checkpoint's
RENAMES = (("model.layers.", "toy.blocks."), ("model.embed_tokens.", "toy.embed."), ("model.norm.", "toy.final_norm."),
           ("self_attn.", "attn."), ("_proj.", "."), ("lm_head.", "toy.head."))
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = [1, 23, 70, 5]


def toy_name(name: str) -> str:
    for a, b in RENAMES:
        name = name.replace(a, b)
    return name


class ToyFamily(ModelFamily):
    """A dense decoder under another name: graphcp's decoder layers, its own checkpoint names."""

    name = "toy"
    architectures = {TOY_ARCH: TOY_TYPE}

    def read_config(self, d, model_type, source):
        r = ConfigReader(d, source)
        head = read_head(r)
        return decoder_config(r, model_type, head, rope_from_hf(d, source, head.max_positions))

    def kind(self, cfg) -> str:
        return "dense"

    def attention(self, name, device) -> str:
        return resolve(name, device)

    model_class = DecoderModel  # graphcp's decoder layers

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return {toy_name(n): t for n, t in dense_tensors(cfg, rank, tp, moe, shard).items()}

    def cache_geometry(self, cfg, runtime, kv_layout="NHD"):
        return KVHeads(cfg.num_kv_heads, cfg.head_dim, kv_layout)

    def make_attention(self, parts, workspace=None):
        c, rt = parts.attn_cfg, parts.runtime
        spec = AttentionSpec(c.num_heads, c.num_kv_heads, c.head_dim, rt.page_size, c.head_dim ** -0.5,
                             parts.kv.layout)
        return make_attention(rt.attention, spec, parts.device)

    def export_meta(self, cfg, num_tokens, runtime, fingerprint, draft_layers):
        return KVMeta(num_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runtime.dtype, runtime.page_size,
                      fingerprint)


TOY = register_family(ToyFamily())


@pytest.fixture(scope="module")
def toy_dirs(hf_model_dir, tmp_path_factory):
    """dtype -> (the toy checkpoint, the Llama checkpoint it renames)."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        llama = hf_model_dir("llama", False, dtype)
        toy = tmp_path_factory.mktemp(f"toy-{dtype}")
        config = json.loads((llama / "config.json").read_text())
        config.update(architectures=[TOY_ARCH], model_type=TOY_TYPE)
        (toy / "config.json").write_text(json.dumps(config))
        weights = load_file(str(llama / "model.safetensors"))
        save_file({toy_name(n): t for n, t in weights.items()}, str(toy / "model.safetensors"))
        out[dtype] = (toy, llama)
    return out


def _tokens(vocab: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(11)
    return [torch.from_numpy(rng.integers(0, vocab, n)) for n in LENS]


def _prefill(group, folder, dtype: str, toks, kv_cache: str):
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=512, kv_cache=kv_cache), group)
    assert eng.parts.family is TOY
    out = eng.prefill([Request(t) for t in toks], all_logits=True)
    export = eng.export_kv(out.handles[2], dst=0)
    return out.logits, export


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_toy_family_runs_through_the_engine_and_the_export(toy_dirs, hf_model, dtype):
    toy, llama = toy_dirs[dtype]
    ref = hf_model(llama, dtype)
    toks = _tokens(512)
    with torch.inference_mode():
        want = [ref(input_ids=t.view(1, -1)).logits[0].float() for t in toks]
        cache = ref(input_ids=toks[2].view(1, -1), use_cache=True).past_key_values
    runs = [_prefill(None, toy, dtype, toks, "replicated")] if dtype == "float32" else []
    runs += [r for mode in ("replicated", "sharded") for r in launch(_prefill, 2, toy, dtype, toks, mode)[:1]]
    for logits, export in runs:
        for got, w in zip(logits, want):
            assert rel_err(got, w) < TOL[dtype]
        for i in range(export.meta.num_layers):  # keys after RoPE, as transformers caches them
            assert rel_err(export.k[i], cache.layers[i].keys[0]) < TOL[dtype]
            assert rel_err(export.v[i], cache.layers[i].values[0]) < TOL[dtype]


def test_graphcp_prefill_loads_the_family_named_by_the_environment(toy_dirs, hf_model, tmp_path):
    toy, llama = toy_dirs["float32"]
    toks = _tokens(512)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"tokens": t.tolist()}) + "\n" for t in toks))
    env = {**os.environ, "GRAPHCP_FAMILIES": Path(__file__).stem,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out.pt"
    p = subprocess.run([sys.executable, "-m", "graphcp", "prefill", "--model", str(toy), "--input", str(requests),
                        "--output", str(out), "--cp", "2", "--kv-tokens", "512", "--no-memory-check"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = torch.load(out)
    with torch.inference_mode():
        ref = hf_model(llama, "float32")
        want = torch.stack([ref(input_ids=t.view(1, -1)).logits[0, -1].float() for t in toks])
    assert rel_err(res["last_logits"], want) < TOL["float32"]


def test_an_unknown_architecture_names_the_registered_ones(toy_dirs):
    from graphcp.errors import ConfigError
    from graphcp.model.config import ModelConfig

    with pytest.raises(ConfigError, match=f"unsupported architectures entry 'NoSuchLM'.*{TOY_ARCH}"):
        ModelConfig.from_hf_dict({"architectures": ["NoSuchLM"]})


NEW = 6


def _generate(group, folder, dtype: str, toks, kv_cache: str):
    """The toy family decodes with nothing of its own: greedy tokens and every step's
    logits (decode graphs, the first replay self-checked)."""
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=512, kv_cache=kv_cache, graph="breakable",
                                              verify_capture=True), group)
    out = eng.generate([t.tolist() for t in toks], NEW, logits=True)
    paths = {s["path"] for s in eng.stats()["decode_steps"]}
    return [o[0] for o in out.tokens], [o[0].float() for o in out.logits], paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_toy_family_decodes_as_transformers_generates(toy_dirs, hf_model, dtype):
    toy, llama = toy_dirs[dtype]
    toks = _tokens(512)
    ref = hf_model(llama, dtype)
    want = []
    with torch.inference_mode():
        for t in toks:
            g = ref.generate(t.view(1, -1), attention_mask=torch.ones(1, len(t), dtype=torch.long), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
            want.append((g.sequences[0, len(t):].tolist(), torch.stack([x[0] for x in g.logits]).float()))
    single = _generate(None, toy, dtype, toks, "replicated")
    sharded = launch(_generate, 2, toy, dtype, toks, "sharded")[0]
    for ids, logits, paths in (single, sharded):
        assert paths == {"graph"}
        for got_ids, got, (w_ids, w) in zip(ids, logits, want):
            if dtype == "float32":  # bfloat16's greedy ids may part from transformers' at a near tie
                assert got_ids == w_ids
                assert rel_err(got, w) < TOL[dtype]
            else:
                assert rel_err(got[0], w[0]) < TOL[dtype]  # the prefill's token, before any tie
    assert sharded[0] == single[0] or dtype == "bfloat16"
    for a, b in zip(sharded[1], single[1]):  # CP 2 over the sharded cache against the single rank
        assert rel_err(a, b) < TOL[dtype]
