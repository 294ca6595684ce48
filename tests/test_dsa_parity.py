"""DSA models (DeepSeek V3.2, GLM-5) against transformers: MLA with its latent cache,
the lightning indexer partitioned over the CP ranks, sparse attention over its top-k.

Tiny random checkpoints (tests/conftest.py's DSA_TINY, index_topk 16): requests shorter
than index_topk (dense attention) and up to 8x longer (sparse), one extending a cached
prefix past index_topk. float32 at relative 1e-4 for DeepSeek V3.2 with YaRN (MLA's
mscale), GLM-5 with a "shared" indexer layer, and both with DeepSeek MoE layers (tp);
at CP 1, 2 and 4, zigzag and interleave, graph off and breakable (one launch per CP
size looping inside the ranks). bfloat16 against transformers in bfloat16 on requests
within index_topk only: past it, a bfloat16 rounding difference flips near-tied
top-k choices (a discontinuous selection), in transformers as in graphcp.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import save_cases
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.config import ModelConfig
from graphcp.model.dsa.sparse import STAT_PAIRS, STAT_REPLICATED, STAT_ROWS
from graphcp.model.dsa.topk import mask_to_positions, select_topk
from graphcp.model.moe.ep import STAT_LAYOUT, STAT_SENT
from graphcp.runtime.capture.buckets import BucketSet

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
BUCKETS = BucketSet((16, 32, 64, 128, 256), padding_factor=64.0)
#: MoE layer 1 (layer 0 dense): 8 experts of 32, 2 a token, one shared expert
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, routed_scaling_factor=2.5)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0,
            rope_theta=10000.0)
CASES = {
    "deepseek_v32-yarn": ("deepseek_v32", dict(rope_parameters=YARN)),
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(indexer_types=["full", "shared"])),
    "deepseek_v32-moe": ("deepseek_v32", dict(MOE, n_group=2, topk_group=1)),
    "glm_moe_dsa-moe": ("glm_moe_dsa", dict(MOE)),
    # one indexer head: a key every head scores negative scores exactly 0, so many rows'
    # k-th best score is tied (the rank-count independence test; no transformers reference)
    "deepseek_v32-ties": ("deepseek_v32", dict(index_n_heads=1)),
}
RUNS = {  # dtype -> (request lengths, prefix, extension of the prefix)
    "float32": ([5, 130, 3, 40], 50, 70),
    "bfloat16": ([5, 16, 1], 6, 9),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


def _tokens(dtype: str, vocab: int = 512):
    lens, prefix, ext = RUNS[dtype]
    rng = np.random.default_rng(19)
    return [rng.integers(0, vocab, n) for n in lens], rng.integers(0, vocab, prefix), rng.integers(0, vocab, ext)


def _prefill(eng: PrefillEngine, dtype: str):
    """The prefix alone, then the batch (the extension of it first): logits, stats, path."""
    toks, prefix, ext = _tokens(dtype)
    h = eng.prefill([Request(prefix)]).handles[0]
    o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
    for x in o.handles:
        eng.release(x)
    return o.logits, dict(o.info.stats), o.info.path


def _job(group, runs):
    """Each (case, folder, dtype, layout, graph, moe, kv_cache) run on this rank: rank 0
    returns logits."""
    out = []
    for case, folder, dtype, layout, graph, moe, kv_cache in runs:
        rt = RuntimeConfig(dtype=dtype, layout=layout, graph=graph, kv_tokens=2048, moe=moe, kv_cache=kv_cache)
        eng = PrefillEngine(folder, rt, group,
                            BUCKETS)
        logits, stats, path = _prefill(eng, dtype)
        out.append((logits if group.rank == 0 else None, stats, path))
    return out


#: the cases run with breakable graphs (capture + self-check cost seconds): at these CP sizes,
#: zigzag then interleave (one layout at CP 1); CP 4 on the MoE case (its exchange too)
BREAKABLE = {"deepseek_v32-yarn": (1, 2), "glm_moe_dsa-moe": (1, 2, 4), "glm_moe_dsa-shared": (2,)}
#: layer-split cache runs (with the ep MoE layout, interleave) at CP > 1: case -> graph mode
LAYER_SPLIT = {"deepseek_v32-moe": "off", "glm_moe_dsa-moe": "breakable"}
#: bfloat16 runs (requests within index_topk): case -> graph mode
BF16 = {"deepseek_v32-yarn": "breakable", "glm_moe_dsa-shared": "off", "deepseek_v32-moe": "off"}


def _runs(folders, cp):
    """Every case in float32 with graph off, each layout, the MoE cases in both MoE
    layouts; breakable graphs (each layout) and bfloat16 for some cases."""
    layouts = ("zigzag",) if cp == 1 else ("zigzag", "interleave")
    runs = []
    for case, folder in folders.items():
        moes = ("tp", "ep") if case.endswith("-moe") else ("tp",)
        for moe in moes:
            runs += [(case, folder, "float32", layout, "off", moe, "replicated") for layout in layouts]
            if cp in BREAKABLE.get(case, ()):
                runs += [(case, folder, "float32", layout, "breakable", moe, "replicated") for layout in layouts]
        if case in BF16:
            runs.append((case, folder, "bfloat16", "zigzag", BF16[case], moes[-1], "replicated"))
        if cp > 1 and case in LAYER_SPLIT:  # the cached prefix fetched from each layer's owner
            runs.append((case, folder, "float32", "interleave", LAYER_SPLIT[case], "ep", "layer-split"))
    return runs


@torch.inference_mode()
def _reference(folder, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    toks, prefix, ext = _tokens(dtype)
    full = torch.from_numpy(np.concatenate([prefix, ext])).view(1, -1)
    refs = [model(input_ids=full).logits[0, len(prefix):].float()]
    return refs + [model(input_ids=torch.from_numpy(t).view(1, -1)).logits[0].float() for t in toks]


@pytest.fixture(scope="module")
def cp1(folders):
    """The single-rank results (the references for the CP runs of the ties case)."""
    runs = _runs(folders, 1)
    return runs, _job(CPGroup(), runs)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dsa_matches_transformers(cp, folders, cp1):
    runs = cp1[0] if cp == 1 else _runs(folders, cp)
    per_rank = [cp1[1]] if cp == 1 else launch(_job, cp, runs)
    refs = {}
    ties_cp1 = {(r[0], r[2]): res[0] for r, res in zip(*cp1) if r[0].endswith("ties")}
    for i, (case, folder, dtype, layout, graph, moe, kv_cache) in enumerate(runs):
        where = f"{case} {dtype} CP {cp} {layout} graph {graph} moe {moe} {kv_cache}"
        logits, _, path = per_rank[0][i]
        assert path == ("eager" if graph == "off" else "graph"), where
        if case.endswith("ties"):  # ties: every CP size and layout as the single rank
            for j, (g, want) in enumerate(zip(logits, ties_cp1[(case, dtype)])):
                assert rel_err(g, want) < 1e-5, f"{where}, request {j}: {rel_err(g, want):.3g} vs CP 1"
            continue
        if (case, dtype) not in refs:
            refs[case, dtype] = _reference(folder, dtype)
        for j, (g, ref) in enumerate(zip(logits, refs[case, dtype])):
            err = rel_err(g, ref)
            assert err < TOL[dtype], f"{where}, request {j} ({ref.shape[0]} tokens): {err:.3g} vs transformers"
        # the indexer's work: each row scored once over the ranks, ~1/C of it on each
        stats = [r[i][1] for r in per_rank]
        if case.endswith("-moe"):  # the MoE layer ran in the layout asked, exchanging rows at C > 1
            assert all(s[STAT_LAYOUT] == moe and (s[STAT_SENT] > 0) == (cp > 1) for s in stats), (where, stats)
        replicated = stats[0][STAT_REPLICATED]
        assert all(s[STAT_REPLICATED] == replicated for s in stats), where
        assert sum(s[STAT_PAIRS] for s in stats) == replicated > 0 or dtype == "bfloat16", where
        assert all(s[STAT_PAIRS] <= 1.25 * replicated / cp for s in stats), (where, stats)


class _Recording:
    """select_topk, counting the rows whose k-th best score is shared by a key left out."""

    def __init__(self):
        self.tied_rows = 0

    def __call__(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        sel = select_topk(scores, k)
        if k < scores.shape[1]:
            kth = scores.topk(k, dim=-1).values[:, -1:]
            need = k - (scores > kth).sum(-1)  # how many of the tied keys fit
            self.tied_rows += int(((scores == kth).sum(-1) > need).sum())
        return sel


def _last_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A wrong top-k: each row's last k visible tokens."""
    visible = scores > float("-inf")
    from_end = visible.flip(-1).cumsum(-1).flip(-1)
    return mask_to_positions(visible & (from_end <= k), min(k, scores.shape[1]))


def test_topk_matters_and_ties_occur(folders):
    """The indexer's choice matters (a wrong top-k fails parity), and the ties case has ties."""
    folder = folders["deepseek_v32-yarn"]
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=2048, moe="tp"))
    refs = _reference(folder, "float32")
    eng.parts.body.attention.selector = _last_k
    logits, stats, _ = _prefill(eng, "float32")
    errs = [rel_err(g, r) for g, r in zip(logits, refs)]
    assert min(errs[0], errs[2]) > 1e-2, errs  # the sparse requests are wrong
    assert max(errs[1], errs[3]) < TOL["float32"], errs  # the dense ones are not scored at all
    assert stats[STAT_ROWS] > 0

    eng = PrefillEngine(folders["deepseek_v32-ties"], RuntimeConfig(kv_tokens=2048, moe="tp"))
    eng.parts.body.attention.selector = rec = _Recording()
    _prefill(eng, "float32")
    assert rec.tied_rows > 10, rec.tied_rows


def test_select_topk_ties_take_the_earliest_whatever_the_row_extent():
    s = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0, float("-inf")],
                      [0.0, 0.0, 0.0, float("-inf"), float("-inf"), float("-inf"), float("-inf")]])
    assert select_topk(s, 3).tolist() == [[0, 1, 3], [0, 1, 2]]
    assert select_topk(s, 5).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]
    # a row alone, or with more masked columns (another rank's block extent): the same choice
    wide = torch.cat([s, torch.full((2, 9), float("-inf"))], dim=1)
    assert select_topk(wide, 3).tolist() == select_topk(s, 3).tolist()
    assert select_topk(s[1:], 3).tolist() == [[0, 1, 2]]


def test_cli_prefill_reports_the_indexer_work_per_rank(folders, tmp_path, capsys):
    """`graphcp prefill --cp 4` on a DSA checkpoint prints each rank's indexer share (~1/4)."""
    from graphcp.cli.main import main

    req = tmp_path / "req.jsonl"
    tokens = np.random.default_rng(5).integers(0, 512, 400).tolist()
    req.write_text(json.dumps({"tokens": tokens}) + "\n")
    out = tmp_path / "out.pt"
    assert main(["prefill", "--model", str(folders["deepseek_v32-yarn"]), "--input", str(req), "--output", str(out),
                 "--kv-tokens", "1024", "--cp", "4", "--layout", "interleave", "--moe", "tp"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("indexer")]
    assert len(line) == 1, line
    shares = [float(s) for s in re.findall(r"pairs \(([0-9.]+)\)", line[0])]
    assert len(shares) == 4 and all(0.24 <= s <= 0.26 for s in shares), line[0]


@torch.inference_mode()
@pytest.mark.parametrize("case", ["deepseek_v32-yarn", "glm_moe_dsa-shared"])
def test_cache_holds_the_latent_rope_key_and_indexer_key_of_transformers(case, folders):
    """After a prefix and its extension, the paged cache holds per token what transformers'
    cache holds (latent, rope key, indexer key where the layer runs the indexer): what a
    decode engine of these models is handed (MlaStorage.read_tokens)."""
    from transformers import AutoModelForCausalLM

    eng = PrefillEngine(folders[case], RuntimeConfig(kv_tokens=2048, moe="tp"))
    _, prefix, ext = _tokens("float32")
    h = eng.prefill([Request(prefix)]).handles[0]
    h = eng.prefill([Request(ext, h)]).handles[0]
    model = AutoModelForCausalLM.from_pretrained(folders[case], dtype=torch.float32).eval()
    full = torch.from_numpy(np.concatenate([prefix, ext])).view(1, -1)
    cache = model(input_ids=full, use_cache=True).past_key_values
    indexer = eng.cfg.dsa.indexer_layers
    for layer in range(eng.cfg.num_layers):
        got, ref = eng.parts.kv.storage.read_tokens(h, layer), cache.layers[layer]
        assert got["latent"].shape == (full.shape[1], eng.cfg.dsa.kv_lora_rank)
        assert rel_err(got["latent"], ref.keys[0, 0]) < 1e-5, (case, layer)
        # transformers lists the rotated pairs' first members, then the second ones
        rope = torch.cat([got["rope_key"][:, 0::2], got["rope_key"][:, 1::2]], dim=-1)
        assert rel_err(rope, ref.values[0, 0]) < 1e-5, (case, layer)
        assert ("index_key" in got) == indexer[layer], (case, layer)
        if indexer[layer]:
            key, r = got["index_key"], eng.cfg.dsa.qk_rope_head_dim
            if eng.cfg.dsa.indexer_rope_interleaved:  # GLM: the same permutation of its rope dims
                key = torch.cat([key[:, :r:2], key[:, 1:r:2], key[:, r:]], dim=-1)
            assert rel_err(key, ref.indexer_keys[0]) < 1e-5, (case, layer)
    assert not all(indexer) or case != "glm_moe_dsa-shared"
    eng.release(h)


def test_refused_settings_name_what_is_wrong(folders, tmp_path):
    from graphcp.errors import ConfigError

    folder = folders["deepseek_v32-yarn"]
    for kw, says in ((dict(graph="full"), "graph='full'"), (dict(attention="flashinfer"), "attention='flashinfer'")):
        with pytest.raises(ConfigError, match=says):
            PrefillEngine(folder, RuntimeConfig(kv_tokens=256, moe="tp", **kw))
    with pytest.raises(ConfigError, match="kv_cache='sharded'"):  # the latent cache is not token-sharded yet
        PrefillEngine(folder, RuntimeConfig(kv_tokens=256, moe="tp", kv_cache="sharded"))
    moe_cfg = ModelConfig.from_file(folders["deepseek_v32-moe"] / "config.json")
    for layout, says in (("ep", "num_experts=8 does not divide by cp_size=3"),
                         ("tp", "intermediate size 32 does not divide by cp_size=3")):
        with pytest.raises(ConfigError, match=says):  # DeepSeek MoE splits like the other MoE families
            moe_cfg.check_parallel(ParallelConfig(cp_size=3), "the model", layout)
    for case, key, value, says in (
            ("deepseek_v32-yarn", "q_lora_rank", None, "q_lora_rank is null"),
            ("deepseek_v32-yarn", "quantization_config", {"quant_method": "fp8"}, "quantization_config"),
            ("deepseek_v32-yarn", "num_key_value_heads", 2, "num_key_value_heads=2"),
            ("deepseek_v32-moe", "n_group", 3, "num_experts=8 does not divide into n_group=3"),
            ("deepseek_v32-moe", "topk_group", 3, "topk_group"),
            ("deepseek_v32-moe", "n_group", 8, "each of the n_group=8 expert groups needs >= 2 experts")):
        cfg = json.loads((folders[case] / "config.json").read_text())
        bad = tmp_path / f"{key}-{value}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError, match=says):
            ModelConfig.from_file(bad / "config.json")


@pytest.mark.parametrize("dtype, moe", [("float32", "tp"), ("bfloat16", "tp"), ("bfloat16", "ep")])
def test_replay_equals_the_same_bucket_eager_body_bitwise(folders, dtype, moe):
    """Breakable graphs on a DSA model: one break a layer (indexer + sparse attention;
    with moe='ep' the MoE layer's exchange too), the replay's hidden rows and both
    cache pools equal the same-bucket eager body's, on requests past index_topk."""
    rt = RuntimeConfig(graph="breakable", kv_tokens=2048, moe=moe, dtype=dtype)
    eng = PrefillEngine(folders["glm_moe_dsa-moe"], rt, buckets=BucketSet((64, 256)))
    stats = eng.capture()  # capture first: a lazy capture would refill the buffers between the two runs
    assert all(s.breaks == eng.cfg.num_layers for s in stats), [vars(s) for s in stats]
    toks, prefix, ext = _tokens("float32")
    h = eng.prefill([Request(prefix)]).handles[0]
    prep = eng.parts.preparer.prepare([Request(ext, h)] + [Request(t) for t in toks])
    sel = eng.parts.runner.select(prep.plan.max_local_rows)
    pools = eng.parts.kv.page_pools()
    before = {n: p.clone() for n, p in pools.items()}
    want = eng.parts.runner.eager_on_bucket(prep, sel.capacity).clone()
    want_pools = {n: p.clone() for n, p in pools.items()}
    for n, p in pools.items():
        p.copy_(before[n])
    got, info = eng.parts.runner.try_replay(prep)
    assert info.path == "graph" and sel.capacity == 256
    assert torch.equal(got, want)
    assert set(pools) == {"latent_cache", "index_key_cache"}
    assert all(torch.equal(pools[n], want_pools[n]) for n in pools)
    assert any(not torch.equal(pools[n], before[n]) for n in pools)  # the batch wrote the caches
    eng.parts.preparer.abort(prep)


@torch.inference_mode()
def test_default_dsa_preset_is_a_hub_checkpoint_transformers_agrees_with(tmp_path):
    """The `default-dsa` preset (DeepSeek V3.2, MoE past layer 0, index_topk 256) loads in
    transformers with every tensor present, and graphcp's logits match it."""
    from transformers import AutoModelForCausalLM

    from graphcp.model.presets import ensure_preset

    folder = ensure_preset("default-dsa", tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, moe="tp"))
    toks = [np.random.default_rng(7).integers(0, 8192, n) for n in (300, 20)]
    out = eng.prefill([Request(t) for t in toks], all_logits=True)
    assert out.info.stats[STAT_ROWS] == eng.cfg.dsa.num_indexer_layers * (300 - 256)
    for t, got in zip(toks, out.logits):
        ref = model.eval()(input_ids=torch.from_numpy(t).view(1, -1)).logits[0].float()
        assert rel_err(got, ref) < TOL["float32"], (len(t), rel_err(got, ref))
