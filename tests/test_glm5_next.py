"""GLM-5-Next's text model (docs/glm5_next.md) against transformers'
``Glm5NextForConditionalGeneration``, on GLM_TINY: KDA, indexed ('full'), indexed
('shared'), KDA, indexed ('full'); 16 indexer heads of random weights (a sum of 16 ReLU
terms is almost never an exact tie, so transformers' own top-k is defined), pools of 4,
index_topk 16 (rows from position 19 select); 2 streams; SwiGLUs clamped at 1 (the clamp
bites); layer 0 dense, then 8 experts top-2 of 2 groups and a shared expert:

- the pooled selection equals transformers' indexer's, row by row;
- the engine at CP 1 and 2 (4: tests/test_glm5_next_cache.py), graphs off and breakable
  (graph = eager bitwise: the same run's eager forward), ``--moe ep`` and ``tp``, the
  replicated and layer-split caches: requests of 1 to 300 tokens in one batch, every
  token's logits within 1e-4 (float32) of transformers', and the long request in three
  pieces (a 2-token prefix inside the convolution's halo; a cut inside a zigzag block,
  mid-pool) equal to one shot; bfloat16 within 2e-2 on the all-experts twin;
- a checkpoint in transformers' in-memory spelling loads as the saved one;
- refused, one line: the token-sharded cache, interleave, auxiliary hidden states, a stage
  starting at a 'shared' layer, and bad checkpoints (decode: tests/test_glm5_next_decode.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import randomise_
from safetensors.torch import load_file, save_file
from test_error_contract import one_line_error
from test_hybrid import check_logits

from graphcp import BatchError, ConfigError, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.config import ModelConfig
from graphcp.model.glm5_next.indexer import Glm5Indexer, pooled_selection
from graphcp.runtime.capture.buckets import BucketSet

GLM_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=24, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, rms_norm_eps=1e-6, max_position_embeddings=4096,
    pad_token_id=None, bos_token_id=None, eos_token_id=None, index_n_heads=16, index_head_dim=16, index_topk=16,
    index_kpool=4, hc_mult=2, hc_sinkhorn_iters=5, swiglu_limit=1.0,
)
#: a one-block vision tower (not read: the text model's tensors only), its token ids inside the vocabulary
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, projection_intermediate_size=64)
TOKEN_IDS = dict(image_token_id=500, video_token_id=501, image_start_token_id=502, image_end_token_id=503,
                 video_start_token_id=504, video_end_token_id=505)
#: the twin bfloat16 runs on: every expert (no router top-k to flip under rounding) and
#: index_topk past the longest request (no pool selection to flip: attention is dense, as
#: the DSA suites' bfloat16 twins; the selection is checked in float32)
ALL_EXPERTS = dict(num_experts_per_tok=8, n_group=1, index_topk=512)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = [1, 7, 45, 300]
#: the long request's pieces: a 2-token prefix (inside the convolution's 3-row halo), then one
#: ending at 203 (inside a zigzag block at CP 2 and 4, and inside a pool of 4), then the rest
CUTS = (2, 203)
BUCKETS = BucketSet((64, 256, 512), padding_factor=64.0)
#: CP size -> (dtype, graph, cache mode, moe) runs
RUNS = {
    2: [("float32", "off", "replicated", "ep"), ("float32", "breakable", "layer-split", "tp"),
        ("bfloat16", "breakable", "replicated", "ep")],
}


def build_glm5(seed: int = 0, **overrides):
    """The tiny model, float32, with non-trivial weights (conftest's randomise_; a KDA
    layer's q/k/v rows scaled up as conftest does Kimi's; the embedding's rows of order 1,
    as a real model's residual is: with randomise_'s 1 / sqrt(hidden) the first KDA layer's
    bfloat16 rounding alone is 2 % of the logits, in transformers' run as in ours)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**GLM_TINY, **overrides}, vision_config=dict(VISION), **TOKEN_IDS)
    model = Glm5NextForConditionalGeneration(cfg).to(torch.float32)
    randomise_(model, seed)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "Glm5NextTextLinearAttention":
                for proj in (mod.q_proj, mod.k_proj, mod.v_proj):
                    proj.weight.mul_(8.0)
        model.model.language_model.embed_tokens.weight.mul_(8.0)
    return model.eval()


class Folders(dict):
    """dtype -> the folder of the model that dtype runs on (float32: GLM_TINY; bfloat16: the
    twin), each saved when first asked for."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self.factory = tmp_path_factory

    def __missing__(self, dtype: str):
        folder = self.factory.mktemp(f"glm5next-{dtype}")
        build_glm5(**(ALL_EXPERTS if dtype == "bfloat16" else {})).save_pretrained(folder)
        self[dtype] = folder
        return folder


def save_folders(tmp_path_factory) -> Folders:
    return Folders(tmp_path_factory)


_MODELS: dict = {}


def glm_model(folder, dtype: str = "float32"):
    """transformers' model of a folder (cached)."""
    from transformers import Glm5NextForConditionalGeneration

    key = (str(folder), dtype)
    if key not in _MODELS:
        _MODELS[key] = Glm5NextForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    return _MODELS[key]


def tokens():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 500, n) for n in LENS]


def reference_logits(folders) -> dict:
    """transformers' logits of every request, in each dtype (bfloat16: the twin's)."""
    out = {}
    for dtype in TOL:
        folder = folders[dtype]
        with torch.no_grad():
            out[dtype] = [glm_model(folder, dtype)(torch.tensor(t)[None]).logits[0].float() for t in tokens()]
    return out


@pytest.fixture(scope="module")
def glm_folders(tmp_path_factory):
    return save_folders(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(glm_folders):
    return reference_logits(glm_folders)


def test_the_pooled_selection_is_transformers_indexers():
    """Row by row, the tokens transformers' indexer selects (its top pools, ties absent with
    16 heads, plus the row's incomplete pool) are the ones pooled_selection gives; rows
    before position topk + kpool - 1 read every token up to their own."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = Glm5NextTextConfig(**{k: v for k, v in GLM_TINY.items() if k not in ("pad_token_id",)})
    ref = Glm5NextTextIndexer(cfg, 1).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3))
    mcfg = ModelConfig.from_hf_dict({"architectures": ["Glm5NextForConditionalGeneration"],
                                     "text_config": dict(GLM_TINY)}, "test")
    ix = mcfg.hybrid.indexer
    mine = Glm5Indexer(ix, 64, 32, torch.float32)
    with torch.no_grad():
        for name in ("wq_b", "wk", "weights_proj"):
            getattr(mine, name).weight.copy_(getattr(ref, name).weight)
        mine.k_norm.load_state_dict(ref.k_norm.state_dict())
        mine.ape.copy_(ref.index_kpool_compress_ape)
        mine.gate.copy_(ref.index_kpool_compress_gate)
    T = 90
    x, q_resid = torch.randn(1, T, 64, generator=g), torch.randn(1, T, 32, generator=g)
    with torch.no_grad():
        want = ref(x, q_resid, torch.ones(1, T, dtype=torch.bool), None)[0].long()
        q, w, rows = mine(x[0], q_resid[0])
    assert want.shape[1] == ix.width
    W = ix.width
    pos = torch.arange(W, T)
    got = pooled_selection(q[W:], w[W:], rows, mine.ape, pos, ix)
    for i, p in enumerate(range(W, T)):
        assert set(got[i].tolist()) - {-1} == set(want[p].tolist()) - {-1}, p
    for p in range(W):  # dense rows
        assert set(want[p].tolist()) - {-1} == set(range(p + 1)), p
    # a wrong rule is seen: the worst pools instead of the best
    worst = pooled_selection(-q[W:], w[W:], rows, mine.ape, pos, ix)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(worst, got))


def _run(eng: PrefillEngine) -> tuple[list, torch.Tensor, set]:
    """The batch in one forward, then the long request in three pieces (CUTS) beside a
    short one; every token's logits, and the paths the forwards took."""
    toks = tokens()
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    for h in one.handles:
        eng.release(h)
    long, (a, b) = toks[3], CUTS
    head = eng.prefill([Request(long[:a])], all_logits=True)
    mid = eng.prefill([Request(long[a:b], head.handles[0]), Request(toks[1])], all_logits=True)
    tail = eng.prefill([Request(long[b:], mid.handles[0])], all_logits=True)
    for h in (*mid.handles[1:], *tail.handles):
        eng.release(h)
    paths = {one.info.path, head.info.path, mid.info.path, tail.info.path}
    return [x.clone() for x in one.logits], torch.cat([head.logits[0], mid.logits[0], tail.logits[0]]), paths


def _runs_job(group, folders, runs):
    out = []
    for dtype, graph, mode, moe in runs:
        # verify_capture: each bucket's first replay compared bitwise with the same forward
        # run eagerly on the bucket (a difference is a CaptureError): graph = eager
        rt = RuntimeConfig(dtype=dtype, graph=graph, kv_cache=mode, moe=moe, kv_tokens=4096,
                           verify_capture=graph != "off")
        eng = PrefillEngine(folders[dtype], rt, group, BUCKETS)
        res = _run(eng)
        verified = eng.parts.runner.prefill.verified if graph != "off" else None
        out.append((*res, verified) if group.rank == 0 else None)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_matches_transformers_and_the_pieces_one_shot(glm_folders, reference, dtype):
    one, pieces, paths = _run(PrefillEngine(glm_folders[dtype], RuntimeConfig(dtype=dtype, kv_tokens=4096)))
    assert paths == {"eager"}
    check_logits(one, reference[dtype], dtype, "one shot")
    check_logits([pieces], [reference[dtype][3]], dtype, "pieces")


@pytest.mark.parametrize("cp", sorted(RUNS))
def test_cp_matches_transformers(glm_folders, reference, cp):
    results = launch(_runs_job, cp, dict(glm_folders), RUNS[cp])[0]
    for (dtype, graph, mode, moe), (one, pieces, paths, verified) in zip(RUNS[cp], results):
        where = (cp, dtype, graph, mode, moe)
        assert paths == {"graph" if graph != "off" else "eager"}, where
        assert graph == "off" or verified, where  # graph = eager, bitwise, on every bucket replayed
        check_logits(one, reference[dtype], dtype, where)
        check_logits([pieces], [reference[dtype][3]], dtype, where)


def test_the_in_memory_spelling_loads_as_the_saved_one(glm_folders, tmp_path):
    """transformers' in-memory names (``attn_hc.fn``, a stacked conv, ``forget_gate.``, merged
    experts: its state dict saved as it is) read to the same model."""
    folder = glm_folders["float32"]
    mem = tmp_path / "in-memory"
    mem.mkdir()
    shutil.copy(folder / "config.json", mem / "config.json")
    state = {k: v.contiguous() for k, v in glm_model(folder).state_dict().items()}
    assert any(".attn_hc.fn" in k for k in state) and any(".experts.gate_up_proj" in k for k in state)
    save_file(state, mem / "model.safetensors", metadata={"format": "pt"})
    toks = tokens()
    for moe in ("ep", "tp"):
        got = [PrefillEngine(f, RuntimeConfig(kv_tokens=512, moe=moe)).prefill([Request(t) for t in toks]).last_logits
               for f in (folder, mem)]
        assert torch.equal(got[0], got[1]), moe


@pytest.mark.parametrize("runtime,match", [
    (dict(kv_cache="sharded"), r"kv_cache='sharded'.*one latent row a token"),
    (dict(layout="interleave"), r"layout='interleave'.*state map per token"),
    (dict(aux_hidden_layers=(1,)), r"aux_hidden_layers with a GLM-5-Next model: a layer's output is hc_mult"),
])
def test_refused_runs_are_one_line(glm_folders, runtime, match):
    with pytest.raises(ConfigError, match=match) as e:
        PrefillEngine(glm_folders["float32"], RuntimeConfig(**runtime))
    assert "\n" not in str(e.value)


def test_a_call_asking_for_auxiliary_hidden_states_is_refused_and_changes_nothing(glm_folders):
    eng = PrefillEngine(glm_folders["float32"], RuntimeConfig(kv_tokens=512))
    with pytest.raises(BatchError, match=r"aux_hidden_layers with a GLM-5-Next model: .* hc_mult") as e:
        eng.prefill([Request([1, 2, 3, 4])], aux_hidden_layers=[1])
    assert "\n" not in str(e.value) and eng.parts.kv.stored_tokens() == 0
    eng.release(eng.prefill([Request([1, 2, 3, 4])]).handles[0])


def test_a_stage_may_not_start_at_a_shared_layer(glm_folders):
    from graphcp.model.family import family_of

    cfg = ModelConfig.from_hf_dict(json.loads((glm_folders["float32"] / "config.json").read_text()), "test")
    family = family_of(cfg)
    family.check_run(cfg, RuntimeConfig(), ParallelConfig(pp_size=2, pp_layers=(3, 2)))  # stage 1 at layer 3: KDA
    with pytest.raises(ConfigError, match=r"stage 1 starts at layer 2, a 'shared' indexed layer .* --pp-layers") as e:
        family.check_run(cfg, RuntimeConfig(), ParallelConfig(pp_size=2, pp_layers=(2, 3)), flags=True)
    assert "\n" not in str(e.value)


def _edit(src, dst, text=None, drop=None):
    shutil.copytree(src, dst)
    if text is not None:
        d = json.loads((dst / "config.json").read_text())
        d["text_config"].update(text)
        (dst / "config.json").write_text(json.dumps(d))
    if drop is not None:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


P = "model.language_model.layers."


@pytest.mark.parametrize("edit,match", [
    (dict(drop=P + "0.self_attn.A_log"), r"missing tensor 'model\.language_model\.layers\.0\.self_attn\.A_log'"),
    (dict(drop=P + "1.self_attn.indexer.index_kpool_compress_ape"), r"missing tensor .*index_kpool_compress_ape"),
    (dict(drop=P + "3.hc_attn_fn"), r"missing tensor 'model\.language_model\.layers\.3\.hc_attn_fn'"),
    (dict(text={"index_topk": 18}), r"index_topk=18 must be divisible by index_kpool=4"),
    (dict(text={"indexer_types": ["full", "shared", "full", "full", "full"]}),
     r"layer 1 is a 'shared' indexed layer .* layer 0 is not a 'full' indexed layer"),
    (dict(text={"qk_rope_head_dim": 8}), r"qk_rope_head_dim=8: GLM-5-Next's indexed layers have no RoPE"),
    (dict(text={"num_key_value_heads": 2}), r"num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(text={"index_kpool_always_select_tail": False}), r"index_kpool_always_select_tail=false is not supported"),
])
def test_bad_input_is_one_line(glm_folders, tmp_path, capsys, edit, match):
    bad = _edit(glm_folders["float32"], tmp_path / "bad", **edit)
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    one_line_error(capsys, ["prefill", "--model", bad, "--input", req, "--output", tmp_path / "o.pt"], match=match)


def test_the_preset_prefills_from_the_command_line(tmp_path, monkeypatch):
    from graphcp.cli.main import main
    from graphcp.pd.files import read_kv

    monkeypatch.setenv("GRAPHCP_CACHE", str(tmp_path / "cache"))
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in ([1, 2, 3, 4, 5], [9, 8, 7])))
    out = tmp_path / "out.pt"
    argv = ["prefill", "--model", "default-glm5next", "--input", req, "--output", out, "--cp", "2",
            "--export-kv", tmp_path / "kv"]
    assert main([str(a) for a in argv]) == 0
    logits = torch.load(out)["last_logits"]
    assert logits.shape == (2, 8192) and torch.isfinite(logits).all()
    meta = read_kv(tmp_path / "kv" / "0.safetensors").meta
    assert meta.format == "graphcp-glm5next/1" and meta.num_tokens == 5 and meta.index_layers == (2, 5)
