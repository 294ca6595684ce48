"""DeepSeek V4 (``DeepseekV4ForCausalLM``) against transformers, under CP.

A tiny random checkpoint (tests/conftest.py's V4_TINY): a sliding layer, a CSA layer
(m = 4, index_topk 3, 16 indexer heads) and an HCA layer (m' = 8), a window of 8,
mHC of 2 streams, hash-routed MoE (random ``tid2eid``) in layers 0 and 2 and
score-routed MoE in layer 1. Requests of 1 to 93 tokens (up to 11 windows, 23 CSA and
11 HCA blocks), odd lengths, and one extending a 21-token cached prefix (it splits a
block of both compressors). float32 at relative 1e-4 on every token's logits at CP 1,
2 and 4, zigzag and interleave, graphs off and breakable (each capture's self-check
replays a synthetic batch bitwise against the same-bucket eager body), ``--moe ep``
and ``tp``; the indexer's and attention's rows a rank computes at C = 4 within 1.25 / C
of the replicated count. bfloat16: against transformers in bfloat16 given graphcp's
top-k (a bfloat16 rounding flips near-tied selections, in transformers as in graphcp),
on the all-experts twin (the router's choice flips the same way). The compositions
(attention DP, pipeline stages, the layer-split cache, attention TP) against one rank
in float32 and bfloat16 (on the twin that scores no row): one job, MESH_BATCH.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_cases
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.dsv4.sparse import (
    REPLICATED,
    STAT_ATTN_PAIRS,
    STAT_ATTN_ROWS,
    STAT_INDEX_PAIRS,
    STAT_INDEX_ROWS,
)
from graphcp.runtime.capture.buckets import BucketSet

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
BUCKETS = BucketSet((64, 128, 256), padding_factor=64.0)
LENS, PREFIX, EXT = [1, 7, 45, 93], 21, 30
CASES = {"v4": ("deepseek_v4", {}),
         # bfloat16: every token to every expert (hash layers too: 8 of 8)
         "v4-all-experts": ("deepseek_v4", dict(num_experts_per_tok=8)),
         # bfloat16 against another split of the same sums (attention TP): no row scored either
         # (a near-tied top-k flips between two roundings of the indexer's inputs, as the router's)
         "v4-unscored": ("deepseek_v4", dict(num_experts_per_tok=8, index_topk=64))}
#: CP size -> (dtype, layout, graph, moe) runs
RUNS = {
    1: [("float32", "zigzag", "off", "tp"), ("float32", "zigzag", "breakable", "ep"),
        ("bfloat16", "zigzag", "breakable", "tp")],
    2: [("float32", "zigzag", "off", "ep"), ("float32", "interleave", "off", "tp"),
        ("float32", "zigzag", "breakable", "tp"), ("float32", "interleave", "breakable", "ep"),
        ("bfloat16", "interleave", "off", "ep")],
    4: [("float32", "zigzag", "off", "tp"), ("float32", "interleave", "off", "ep"),
        ("float32", "zigzag", "breakable", "ep"), ("bfloat16", "zigzag", "breakable", "tp")],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


def _tokens():
    rng = np.random.default_rng(19)
    return [rng.integers(0, 512, n) for n in LENS], rng.integers(0, 512, PREFIX), rng.integers(0, 512, EXT)


def _record(eng: PrefillEngine) -> dict:
    """Every selection the indexer makes: (layer, the request's first page, position) -> entries."""
    att, records = eng.parts.body.attention, {}
    inner = att.select

    def select(layer, group, on_device, block, pos, seen, iq, iw, ik):
        keep = inner(layer, group, on_device, block, pos, seen, iq, iw, ik)
        first = int(group.pages[0])
        for p, row, n in zip(pos.tolist(), keep.cpu(), seen.tolist()):
            if n > att.spec.index_topk:
                records[layer, first, p] = row.nonzero().view(-1)
        return keep

    att.select = select
    return records


def _job(group, runs):
    """Each run: the prefix, then the batch extending it; (logits on rank 0, stats, path,
    selections, the requests' first pages, capture self-checks skipped)."""
    out = []
    for folder, dtype, layout, graph, moe in runs:
        rt = RuntimeConfig(dtype=dtype, layout=layout, graph=graph, moe=moe, kv_tokens=2048, page_size=8)
        eng = PrefillEngine(folder, rt, group, BUCKETS)
        skipped = [s.verify_skipped for s in eng.capture()] if graph != "off" else []
        records = _record(eng)
        toks, prefix, ext = _tokens()
        h = eng.prefill([Request(prefix)]).handles[0]
        o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
        out.append(([x.clone() for x in o.logits] if group.rank == 0 else None, dict(o.info.stats), o.info.path,
                    records, [x.pages[0] for x in o.handles], skipped))
    return out


def _inject(model, records: dict, first_page: int, topk: int) -> None:
    """transformers' indexers replaced by graphcp's selections for one request (rows
    that see at most ``topk`` entries: all of them, as transformers' top-k gives)."""
    for layer, block in enumerate(model.model.layers):
        comp = block.self_attn.compressor
        indexer = getattr(comp, "indexer", None)
        if indexer is None:
            continue

        def forward(hidden_states, q_residual, position_ids, cache, layer_idx, layer=layer, m=indexer.compress_rate):
            s = hidden_states.shape[1]
            k = min(topk, s // m)
            rows = []
            for p in range(s):
                seen = (p + 1) // m
                sel = records[layer, first_page, p] if seen > topk else torch.arange(min(seen, k))
                rows.append(torch.cat([sel, torch.full((k - sel.numel(),), -1, dtype=torch.long)]))
            return torch.stack(rows).view(1, s, k)

        indexer.forward = forward


@torch.inference_mode()
def _references(folder, dtype: str, records=None, firsts=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    toks, prefix, ext = _tokens()
    seqs = [np.concatenate([prefix, ext])] + toks
    refs = []
    for j, seq in enumerate(seqs):
        if records is not None:
            _inject(model, records, firsts[j], model.config.index_topk)
        refs.append(model(input_ids=torch.from_numpy(seq).view(1, -1)).logits[0].float())
    refs[0] = refs[0][PREFIX:]
    return refs


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dsv4_matches_transformers(cp, folders):
    runs = [(folders["v4" if dtype == "float32" else "v4-all-experts"], dtype, layout, graph, moe)
            for dtype, layout, graph, moe in RUNS[cp]]
    per_rank = [_job(CPGroup(), runs)] if cp == 1 else launch(_job, cp, runs)
    f32 = None
    for i, (folder, dtype, layout, graph, moe) in enumerate(runs):
        where = f"{dtype} CP {cp} {layout} graph {graph} moe {moe}"
        logits, _, path, _, firsts, skipped = per_rank[0][i]
        assert path == ("eager" if graph == "off" else "graph"), where
        assert all(s is None for s in skipped), (where, skipped)  # every bucket's replay was checked
        if dtype == "float32":
            f32 = f32 or _references(folder, dtype)
            refs = f32
        else:  # transformers given every rank's selections
            records = {}
            for r in per_rank:
                records.update(r[i][3])
            assert records, where  # rows past index_topk were scored
            refs = _references(folder, dtype, records, firsts)
        for j, (got, ref) in enumerate(zip(logits, refs)):
            err = rel_err(got, ref)
            assert err < TOL[dtype], f"{where}, request {j} ({ref.shape[0]} tokens): {err:.3g} vs transformers"
        _assert_partitioned([r[i][1] for r in per_rank], where, bound=False)
        # the exchange's bytes: every other rank's window and source rows, each layer
        assert all((r[i][1]["bytes_received"] > 0) == (cp > 1) for r in per_rank), where


def _assert_partitioned(stats: list[dict], where: str, bound: bool = True) -> None:
    """Each row scored and attended once over the ranks; ``bound``: at most 1.25 / C of the
    replicated work on each rank."""
    for key in (STAT_INDEX_ROWS, STAT_INDEX_PAIRS, STAT_ATTN_ROWS, STAT_ATTN_PAIRS):
        replicated = stats[0][key + REPLICATED]
        assert replicated > 0 and all(s[key + REPLICATED] == replicated for s in stats), (where, key)
        assert sum(s[key] for s in stats) == replicated, (where, key, [s[key] for s in stats])
        if bound:
            assert all(s[key] <= 1.25 * replicated / len(stats) for s in stats), (where, key, [s[key] for s in stats])


def _work_job(group, folder, layout):
    eng = PrefillEngine(folder, RuntimeConfig(layout=layout, kv_tokens=4096, page_size=8), group)
    rng = np.random.default_rng(1)
    return dict(eng.prefill([Request(rng.integers(0, 512, n)) for n in (300, 517)]).info.stats)


@pytest.mark.parametrize("layout", ["zigzag", "interleave"])
def test_work_per_rank_at_cp4(folders, layout):
    """The indexer's scored rows and pairs and attention's rows and pairs a rank computes
    at C = 4 are within 1.25 / C of one rank computing every row (requests of 300 and
    517 tokens; a batch of a few short requests can put most scored rows, those past
    index_topk entries, on the ranks holding late zigzag blocks)."""
    _assert_partitioned(launch(_work_job, 4, folders["v4"], layout), f"CP 4 {layout}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_row_blocks_match_transformers(folders, monkeypatch, dtype):
    """The reference's row blocks (bounded by BLOCK_ROWS / BLOCK_BYTES) at 5 rows: blocks
    that split a request's rows, its window keys and its entries, as one block does
    (bfloat16: on the twin that scores no row, so no near-tied selection can flip)."""
    from graphcp.model.dsv4 import sparse as dsv4

    monkeypatch.setattr(dsv4, "BLOCK_ROWS", 5)
    folder = _mesh_folder(folders, dtype)
    refs = _references(folder, dtype)
    toks, prefix, ext = _tokens()
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048, page_size=8, layout="interleave"))
    h = eng.prefill([Request(prefix)]).handles[0]
    o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
    assert max(rel_err(g, r) for g, r in zip(o.logits, refs)) < TOL[dtype]


def test_routing_and_selection_matter(folders):
    """A wrong hash table, or a wrong top-k, fails parity: both are exercised."""
    folder = folders["v4"]
    refs = _references(folder, "float32")
    toks, prefix, ext = _tokens()
    for wrong in ("tid2eid", "topk"):
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=2048, page_size=8))
        if wrong == "tid2eid":
            table = eng.parts.model.layers[0].mlp.router.tid2eid
            table.copy_(table.roll(1, dims=0))
        else:  # each row's first index_topk entries instead of the indexer's choice
            att = eng.parts.body.attention
            inner = att.select

            def first_k(*args, inner=inner, topk=att.spec.index_topk):
                keep = inner(*args)
                return keep & (torch.arange(keep.shape[1])[None, :] < topk)

            att.select = first_k
        h = eng.prefill([Request(prefix)]).handles[0]
        o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
        errs = [rel_err(g, r) for g, r in zip(o.logits, refs)]
        assert errs[4] > 1e-2, (wrong, errs)  # the 93-token request


def _short_job(group, folder):
    eng = PrefillEngine(folder, RuntimeConfig(dtype="bfloat16", graph="breakable", kv_tokens=2048, page_size=8),
                        group, BUCKETS)
    rng = np.random.default_rng(4)
    prefix, toks = rng.integers(0, 512, 6), [rng.integers(0, 512, n) for n in (9, 1, 5, 13, 15)]
    h = eng.prefill([Request(prefix)]).handles[0]
    o = eng.prefill([Request(toks[0], h)] + [Request(t) for t in toks[1:]], all_logits=True)
    assert o.info.stats[STAT_INDEX_ROWS + REPLICATED] == 0  # no row sees more than index_topk entries
    return [np.concatenate([prefix, toks[0]])] + toks[1:], [x.clone() for x in o.logits], o.info.path


@torch.inference_mode()
def test_bf16_unscored_requests_match_transformers(folders):
    """bfloat16 with the selection free, where no row is scored (at most index_topk
    entries each): CP 2, breakable graphs, against transformers in bfloat16."""
    from transformers import AutoModelForCausalLM

    folder = folders["v4-all-experts"]
    seqs, logits, path = launch(_short_job, 2, folder)[0]
    assert path == "graph"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    for j, (seq, got) in enumerate(zip(seqs, logits)):
        ref = model(input_ids=torch.from_numpy(seq).view(1, -1)).logits[0].float()[len(seq) - got.shape[0]:]
        assert rel_err(got, ref) < TOL["bfloat16"], (j, rel_err(got, ref))


def test_bad_v4_settings_are_one_line_errors(folders, tmp_path, capsys):
    """A page size that does not divide (or is not a multiple of) a compress rate, a
    config without the two RoPEs, a float hash table: ConfigError / CheckpointError
    naming the value."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from graphcp.cli.main import main
    from graphcp.errors import ConfigError
    from graphcp.model.loader import CheckpointError

    with pytest.raises(ConfigError, match=r"RuntimeConfig.page_size=6: .*compress rate 4"):
        PrefillEngine(folders["v4"], RuntimeConfig(kv_tokens=512, page_size=6))
    req = tmp_path / "req.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    capsys.readouterr()
    assert main(["prefill", "--model", str(folders["v4"]), "--page-size", "6", "--input", str(req),
                 "--output", str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphcp prefill: error: --page-size=6: ") and len(err.splitlines()) == 1, err
    # 8 experts do not split over 3 ranks (refused before any rank starts)
    assert main(["prefill", "--model", str(folders["v4"]), "--cp", "3", "--moe", "ep", "--input", str(req),
                 "--output", str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert "num_experts=8 does not divide by --cp 3" in err and len(err.splitlines()) == 1, err
    bad = tmp_path / "bad"
    shutil.copytree(folders["v4"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default"}}))
    with pytest.raises(ConfigError, match="rope_parameters must hold 'main' and 'compress'"):
        PrefillEngine(bad, RuntimeConfig(kv_tokens=512))
    (bad / "config.json").write_text(json.dumps(cfg))
    weights = load_file(bad / "model.safetensors")
    name = "model.layers.0.ffn.gate.tid2eid"
    weights[name] = weights[name].float()
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}.*expected an integer table"):
        PrefillEngine(bad, RuntimeConfig(kv_tokens=512))


#: the composition tests' batch: (cached prefix, new tokens) per request
MESH_BATCH = [(21, 30), (0, 7), (0, 40), (13, 6)]


def _mesh_job(group, folder, parallel, dtype: str, graph: str, moe: str, kv_cache: str = "replicated",
              layout: str = "zigzag", microbatches: int = 1, dst: int | None = None) -> dict:
    """MESH_BATCH (prefixes first), then a batch of one request (fewer than attention-DP
    replicas), on one rank of ``parallel``: every logits row, the path, the batch's
    exports (to ``dst``; none under attention DP) and the pool's and exchange's bytes; the pool is what the memory
    check estimates."""
    from graphcp.runtime.engine import prefill_after_prefixes
    from graphcp.runtime.pool_size import pool_bytes, pool_pages

    rt = RuntimeConfig(dtype=dtype, kv_tokens=1024, page_size=8, graph=graph, moe=moe, kv_cache=kv_cache,
                       layout=layout)
    eng = PrefillEngine(folder, rt, group, BUCKETS, parallel)
    rng = np.random.default_rng(2)
    batch = [(rng.integers(0, 512, p) if p else None, rng.integers(0, 512, n)) for p, n in MESH_BATCH]
    o = prefill_after_prefixes(eng, batch, all_logits=True, microbatches=microbatches)
    one = eng.prefill([Request(np.arange(9))], all_logits=True)
    pool = eng.stats()["kv_pool_bytes"]
    assert pool == pool_bytes(eng.cfg, rt, pool_pages(rt, eng.cfg), eng.parts.model.stage.layers, eng.parts.group.rank,
                              eng.parts.group.size), (kv_cache, group.rank)
    exports = [eng.export_kv(h, dst) for h in o.handles] if parallel.dp_size == 1 else None  # (refused under DP)
    return {"logits": [x.clone() for x in o.logits + one.logits], "path": o.info.path, "exports": exports, "pool": pool,
            "received": o.info.stats.get("bytes_received", 0)}  # (pipeline forwards count it per stage)


def _mesh_folder(folders, dtype: str) -> str:
    """bfloat16 against another split of the same sums: the twin that scores no row and
    routes to every expert (near-ties flip otherwise, a change of the function)."""
    return folders["v4" if dtype == "float32" else "v4-unscored"]


def _assert_as_one_rank(got: dict, want: dict, dtype: str, where) -> None:
    """Logits and every exported tensor (dtype, shape, values) as the single rank's."""
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    assert max(rel_err(a, b) for a, b in zip(got["logits"], want["logits"], strict=True)) < tol, where
    for w, g in zip(want["exports"], got["exports"], strict=True):
        for i, (a, b) in enumerate(zip(w.layers, g.layers, strict=True)):
            assert sorted(a) == sorted(b), (where, i)
            for name in a:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, (where, i, name)
                assert rel_err(b[name].float(), a[name].float()) < tol, (where, i, name)


def _one_rank(folder, dtype: str) -> dict:
    from graphcp.config import ParallelConfig

    return _mesh_job(CPGroup(), folder, ParallelConfig(), dtype, "off", "ep")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_dp_equals_one_rank(folders, dtype):
    """Attention DP 2 x CP 2 (each replica its own requests and cache, the MoE over the 4
    ranks) returns every request as one rank does, and a batch of one request runs."""
    from graphcp.config import ParallelConfig

    folder = _mesh_folder(folders, dtype)
    want = _one_rank(folder, dtype)
    for graph, moe in (("off", "ep"), ("breakable", "tp")):
        parallel = ParallelConfig(cp_size=2, dp_size=2, tp_size=4)
        for rank, got in enumerate(launch(_mesh_job, 4, folder, parallel, dtype, graph, moe)):
            tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
            errs = [rel_err(a, b) for a, b in zip(got["logits"], want["logits"], strict=True)]
            assert max(errs) < tol, (dtype, graph, moe, rank, errs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipeline_stages_equal_one_rank(folders, dtype):
    """PP 2 (the hc_mult streams handed between stages) x CP 1 (2 micro-batches) and
    x CP 2 (breakable graphs): logits and the exported cache (every stage's layers
    gathered, float32 overlap gates beside model-dtype rows) as one rank's."""
    from graphcp.config import ParallelConfig

    folder = _mesh_folder(folders, dtype)
    want = _one_rank(folder, dtype)
    for cp, graph, moe, m, dst in ((1, "off", "ep", 2, None), (2, "breakable", "tp", 1, 1)):
        per_rank = launch(_mesh_job, 2 * cp, folder, ParallelConfig(cp_size=cp, pp_size=2), dtype, graph, moe,
                          "replicated", "zigzag", m, dst)
        for rank, got in enumerate(per_rank):
            where = (dtype, cp, graph, moe, rank)
            assert got["path"] == ("eager" if graph == "off" else "graph"), where
            if dst is not None and rank != dst:
                assert all(e is None for e in got["exports"]), where
                got = {**got, "exports": want["exports"]}
            _assert_as_one_rank(got, want, dtype, where)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cp,graph,layout,moe", [(2, "breakable", "zigzag", "tp"), (4, "off", "interleave", "ep")])
def test_layer_split_equals_the_replicated_cache(folders, cp, graph, layout, moe, dtype):
    """LayerSplit (each rank keeps its own layers' pools and a scratch layer; the cached
    prefixes' pages fetched from each layer's owner in the break): the replicated
    engine's logits bitwise and its export, each layer from its owner, in a smaller pool."""
    from graphcp.config import ParallelConfig

    folder, parallel = _mesh_folder(folders, dtype), ParallelConfig(cp_size=cp)
    split = launch(_mesh_job, cp, folder, parallel, dtype, graph, moe, "layer-split", layout)
    full = launch(_mesh_job, cp, folder, parallel, dtype, graph, moe, "replicated", layout)
    for rank, (s, f) in enumerate(zip(split, full)):
        where = (dtype, cp, graph, layout, moe, rank)
        assert s["path"] == f["path"] == ("eager" if graph == "off" else "graph"), where
        assert all(torch.equal(a, b) for a, b in zip(s["logits"], f["logits"], strict=True)), where
        for x, y in zip(s["exports"], f["exports"], strict=True):
            assert all(torch.equal(a[n], b[n]) for a, b in zip(x.layers, y.layers, strict=True) for n in a), where
        # the pool: its own layers and a scratch layer where it serves others of a kind
        assert s["pool"] < f["pool"] if cp == 4 else s["pool"] <= f["pool"], where
        assert s["received"] > f["received"], where  # the prefix pages fetched from their owners


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_tp_equals_one_rank(folders, dtype):
    """Attention TP 2 (query heads, sinks and the output groups split, the one KV head,
    compressors and indexer whole on each rank, o_b_proj's partial sums all-reduced) at
    CP 1 and inside CP 2 (breakable graphs): logits and export as one rank's."""
    from graphcp.config import ParallelConfig

    folder = _mesh_folder(folders, dtype)
    want = _one_rank(folder, dtype)
    for cp, graph, moe in ((1, "off", "ep"), (2, "breakable", "tp")):
        parallel = ParallelConfig(cp_size=cp, tp_size=2 * cp)
        for rank, got in enumerate(launch(_mesh_job, 2 * cp, folder, parallel, dtype, graph, moe)):
            where = (dtype, cp, graph, moe, rank)
            assert got["path"] == ("eager" if graph == "off" else "graph"), where
            _assert_as_one_rank(got, want, dtype, where)


def test_multi_token_prediction_tensors_are_skipped(folders, tmp_path):
    """DeepSeek V4 checkpoints ship ``mtp.*`` tensors (not run in prefill): they load."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mtp"
    shutil.copytree(folders["v4"], folder)
    weights = load_file(folder / "model.safetensors")
    weights["mtp.0.attn.wq_a.weight"] = torch.zeros(32, 64)
    save_file(weights, folder / "model.safetensors")
    logits = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, page_size=8)).prefill([Request([1, 2, 3])]).last_logits
    ref = PrefillEngine(folders["v4"], RuntimeConfig(kv_tokens=512, page_size=8)).prefill([Request([1, 2, 3])])
    assert torch.equal(logits, ref.last_logits)
