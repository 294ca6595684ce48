"""The combination matrix (graphcp/combinations.py), checked three ways:

- every allowed pair of option values runs at least once at CP 2 (with 2 stages, 2
  attention-TP ranks and 2 attention-DP replicas where the run has them) on a tiny model, and its logits, auxiliary hidden
  states and exported KV match the single-rank eager engine on the same batch (float32
  1e-5; bfloat16 2e-2, or no further from the float32 result than the single-rank
  bfloat16 engine is; the single-rank engine is checked against transformers by the
  parity tests), the graph path taken where a graph mode is set; an export to one rank
  of the run (``dst``) reaches exactly that rank, under attention TP without and with
  stages too (``DST_RUNS``: triples the pairwise cover need not hold);
- every refused pair, in a configuration where it is the only refused pair, ends the
  Python API and the command line with one line that names both options and the reason;
- the README table and docs/combinations.md are what the declaration generates, and the
  full-graph refusals agree with what each attention backend says of itself.
"""

from __future__ import annotations

import json
from itertools import combinations, product
from pathlib import Path

import numpy as np
import pytest
from cp_utils import rel_err
from eagle3_ref import draft_config, draft_tensors, write_draft

import graphcp.cli.commands as cli_commands
from graphcp import ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.cli.main import main
from graphcp.combinations import (
    AXES,
    REFUSALS,
    applicable,
    classify_pairs,
    combinations_doc,
    covering_runs,
    cpu_values,
    readme_table,
    refusal,
)
from graphcp.dist import launch
from graphcp.errors import ConfigError
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

ROOT = Path(__file__).resolve().parent.parent
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
#: a bfloat16 run past TOL may still be as exact as bfloat16 allows: two bfloat16 engines
#: that sum the same rows in different orders differ by about as much as either differs
#: from float32 (the hybrid's TP 2 run: 2.2e-2 from one rank, yet 2.8e-2 from float32 where
#: one rank is 2.8e-2); it passes if it is no further from the float32 result than the
#: single-rank bfloat16 engine is, times this
BF16_SLACK = 1.25
#: (cached prefix, new tokens): an extend of a prefix from an earlier forward, and a fresh
#: request; past the DSA model's index_topk = 16, so its sparse attention selects
BATCH = [(5, 19), (0, 7)]
BUCKETS = BucketSet((16, 32, 64), padding_factor=64.0)
#: a run with decode on: two decode steps of these tokens (fixed, not sampled: a near-tie
#: between two ranks' roundings must not change what the steps compare) after the prefill
DECODE_TOKENS = ([3, 7], [11, 5])
AUX = (0, 1)
#: a model of each kind: 2 layers (one a stage under PP 2); the MoE and DSA ones a MoE
#: layer and a dense one
MODELS = {
    "dense": ("qwen3", {}),
    "moe": ("qwen3_moe", {}),
    "dsa": ("deepseek_v32", dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5, n_group=2,
                                 topk_group=1)),
    "dsv4": ("deepseek_v4", {}),  # tests/conftest.py's V4_TINY: sliding, CSA and HCA layers, hash and routed MoE
    # tests/conftest.py's HYBRID_TINY Qwen3.5-MoE: three Gated DeltaNet layers and a full one, MoE in each
    "hybrid": ("qwen3_5_moe_text", {}),
    # tests/conftest.py's KIMI_TINY Kimi Linear: two KDA layers, an MLA one, a KDA one; layer 0 dense
    "kda": ("kimi_linear", {}),
}
#: bfloat16 runs each MoE model's all-experts twin (as tests/test_moe_parity.py does): with
#: top-k < E a near-tie in the router flips an expert under bfloat16 rounding between two
#: ways of summing the same rows, a real change of the function, not an error; the DSA
#: twin's indexer likewise selects every token (index_topk 32 >= the batch's 24): its
#: top-k flips the same way (a DSA bfloat16 run with the triton kernel at CP 2 differed by
#: 7e-2 from one rank); tests/test_dsa_bf16_sparse.py checks bfloat16 sparse selection
ALL_EXPERTS = {"moe": dict(num_experts_per_tok=8), "dsa": dict(num_experts_per_tok=8, topk_group=2, index_topk=32),
               "dsv4": dict(num_experts_per_tok=8, index_topk=8), "hybrid": dict(num_experts_per_tok=8),
               "kda": dict(num_experts_per_tok=8, n_group=1)}
CPU_RUNS = covering_runs(cpu_values())


def _run(**kw) -> dict:
    base = {"model": "dense", "dtype": "float32", "layout": "zigzag", "graph": "off", "attention": "torch",
            "kv_cache": "replicated", "exchange": "auto", "pp": "1", "attn_tp": "1", "dp": "1", "aux": "off",
            "export": "on", "draft": "off", "decode": "off", "import": "off"}
    return {**base, **kw}


#: what the pairwise cover need not hold together: an export to one rank under attention
#: TP without stages and with them, a family whose heads split (dense, MoE) and one whose
#: every rank holds the whole KV (V4), in each cache mode that family runs
DST_RUNS = [
    _run(attn_tp=">1"),
    _run(model="moe", dtype="bfloat16", kv_cache="sharded", exchange="pass-kv", attn_tp=">1", moe="tp"),
    _run(model="dsv4", kv_cache="layer-split", attn_tp=">1", moe="ep"),
    _run(attn_tp=">1", pp=">1", kv_cache="layer-split"),
    _run(model="moe", kv_cache="sharded", exchange="pass-q", attn_tp=">1", pp=">1", moe="ep"),
    _run(model="dsv4", dtype="bfloat16", attn_tp=">1", pp=">1", moe="tp"),
]


@pytest.fixture(scope="module")
def folders(hf_model_dir, tmp_path_factory):
    """(model kind, dtype) -> checkpoint folder; "draft" -> an EAGLE-3 draft that fits the
    dense and the MoE model (their attention shapes), fed by their layers 1, 0, 1."""
    out = {(kind, dtype): hf_model_dir(family, False, "float32",
                                       **{**kw, **(ALL_EXPERTS.get(kind, {}) if dtype == "bfloat16" else {})})
           for kind, (family, kw) in MODELS.items() for dtype in AXES["dtype"].values}
    out["draft"] = write_draft(tmp_path_factory.mktemp("draft"), draft_tensors(head_dim=32),
                               draft_config(head_dim=32, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}))
    # the hybrid's (its hidden size 96: tests/conftest.py's HYBRID_TINY)
    out["draft", "hybrid"] = write_draft(
        tmp_path_factory.mktemp("draft-hybrid"), draft_tensors(head_dim=32, hidden=96),
        draft_config(head_dim=32, hidden_size=96, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}))
    return out


def _draft(folders: dict, kind: str) -> str:
    """The EAGLE-3 draft that fits a model kind's attention shape."""
    return str(folders.get(("draft", kind), folders["draft"]))


def _runtime(run: dict, folders: dict) -> RuntimeConfig:
    return RuntimeConfig(dtype=run["dtype"], layout=run["layout"], graph=run["graph"], attention=run["attention"],
                         kv_cache=run["kv_cache"], exchange=run["exchange"], moe=run.get("moe", "ep"),
                         aux_hidden_layers=AUX if run["aux"] == "on" else (), kv_tokens=512,
                         draft=_draft(folders, run["model"]) if run.get("draft") == "on" else None)


def _batch(vocab: int):
    rng = np.random.default_rng(7)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for p, n in BATCH]


def _flat(export) -> list:
    """An export's tensors in a fixed order (K/V per layer, or the DSA cache's per layer)."""
    if hasattr(export, "k"):
        return [*export.k, *export.v]
    return [layer[name] for layer in export.layers for name in sorted(layer)]


def _dsts(world: int) -> list[int]:
    """The ranks an export is sent to alone: rank 1 (under attention TP 2: the second
    attention-TP rank of the first CP rank) and the last rank of the run."""
    return sorted({min(1, world - 1), world - 1})


def _imported(engine, handles) -> dict:
    """Each request's KV exported, imported back into the engine (as another engine's
    payload would be: PrefillEngine.import_kv), and exported again: the payloads and the
    re-exports (which must be equal bitwise), the imports released."""
    payloads = engine.export_kv_batch(handles)
    back = [engine.import_kv(e) for e in payloads]
    again = engine.export_kv_batch(back)
    for h in back:
        engine.release(h)
    return {"payloads": [_flat(e) for e in payloads], "again": [_flat(e) for e in again]}


def _outputs(engine, export: bool, decode: bool, imports: bool = False) -> dict:
    o = prefill_after_prefixes(engine, _batch(engine.cfg.vocab_size), all_logits=True)
    handles, steps = o.handles, []
    for tokens in DECODE_TOKENS if decode else ():  # the export after them holds the decoded tokens
        step = engine.decode(handles, tokens, logits=True)
        handles = step.handles
        steps.append((step.info.path, step.logits))
    out = {"path": o.info.path, "last": o.last_logits, "logits": o.logits, "aux": o.aux_hidden,
           "draft": None if o.draft is None else o.draft.all_logits, "decode": steps,
           "export": [_flat(e) for e in engine.export_kv_batch(handles)] if export else None,
           "import": _imported(engine, handles) if imports else None}
    if export:  # to one rank of the whole run: what that rank gets, None elsewhere
        out["to_one"] = {dst: [None if e is None else _flat(e) for e in engine.export_kv_batch(handles, dst=dst)]
                         for dst in _dsts(engine.world.size)}
    return out


def _parallel(run: dict) -> ParallelConfig:
    """CP 2, and each of stages, attention TP and attention DP that the run has at 2."""
    two = {k: 2 if run.get(k) == ">1" else 1 for k in ("pp", "attn_tp", "dp")}
    return ParallelConfig(cp_size=2, pp_size=two["pp"], dp_size=two["dp"], tp_size=2 * two["dp"] * two["attn_tp"])


def _runs_job(group, runs: list[dict], folders: dict) -> list[dict]:
    out = []
    for run in runs:
        eng = PrefillEngine(folders[run["model"], run["dtype"]], _runtime(run, folders), group, BUCKETS,
                            _parallel(run))
        out.append(_outputs(eng, run["export"] == "on", run["decode"] == "on", run["import"] == "on"))
    return out


def _close(got, ref, truth, dtype: str) -> bool:
    """``got`` equals the single-rank ``ref`` within ``TOL``; in bfloat16, or is no further
    from the float32 ``truth`` than ``ref`` is (within ``BF16_SLACK``)."""
    err = rel_err(got, ref)
    if dtype == "float32" or err <= TOL[dtype]:
        return err <= TOL[dtype]
    return rel_err(got, truth) <= BF16_SLACK * rel_err(ref, truth)


def _references(folders) -> tuple[dict, dict]:
    """The single-rank eager engine's outputs for each (model, dtype, draft, decode) the
    runs use, and the float32 engine's on the same checkpoint (the truth a bfloat16 run
    is measured against when it differs from the bfloat16 reference)."""
    refs, truths = {}, {}
    for kind, dtype, draft, decode in sorted({(r["model"], r["dtype"], r["draft"], r["decode"]) for r in CPU_RUNS + DST_RUNS}):
        aux = AUX if refusal({"model": kind, "aux": "on"}) is None else ()  # (V4 refuses aux)
        for key, out, run_dtype in [(dtype, refs, dtype), ("float32", truths, "float32")]:
            rt = RuntimeConfig(dtype=run_dtype, aux_hidden_layers=aux, kv_tokens=512,
                               draft=_draft(folders, kind) if draft == "on" else None)
            out[kind, dtype, draft, decode] = _outputs(PrefillEngine(folders[kind, dtype], rt), True, decode == "on")
    return refs, truths


@pytest.mark.slow
def test_every_allowed_pair_runs_against_the_single_rank_engine(folders):
    refs, truths = _references(folders)
    for world in sorted({_parallel(r).world_size for r in CPU_RUNS + DST_RUNS}):
        runs = [r for r in CPU_RUNS + DST_RUNS if _parallel(r).world_size == world]
        per_rank = launch(_runs_job, world, runs, folders)
        for rank, results in enumerate(per_rank):
            for run, got in zip(runs, results):
                _check_run(rank, run, got, refs, truths, world)


def _check_run(rank: int, run: dict, got: dict, refs: dict, truths: dict, world: int) -> None:
    where, key = (rank, run), (run["model"], run["dtype"], run["draft"], run["decode"])
    ref, truth, dtype = refs[key], truths[key], run["dtype"]

    def close(field, a_of=lambda o: o):
        for a, b, t in zip(a_of(got[field]), a_of(ref[field]), a_of(truth[field]), strict=True):
            assert _close(a, b, t, dtype), (where, field, rel_err(a, b))

    assert got["path"] == ("eager" if run["graph"] == "off" else "graph"), where
    close("last", lambda o: [o])
    close("logits")
    if run["aux"] == "on":
        close("aux")
    else:
        assert got["aux"] is None, where
    if run["draft"] == "on":  # the draft's logits at every new position
        close("draft")
    else:
        assert got["draft"] is None, where
    assert len(got["decode"]) == (len(DECODE_TOKENS) if run["decode"] == "on" else 0), where
    assert all(path == ("eager" if run["graph"] == "off" else "graph") for path, _ in got["decode"]), where
    close("decode", lambda steps: [logits for _, logits in steps])
    if run["import"] == "on":  # what was imported is what an export of it gives back, bit for bit
        for x, y in zip(got["import"]["again"], got["import"]["payloads"], strict=True):
            assert all(a.equal(b) for a, b in zip(x, y, strict=True)), (where, "import")
        for x, y, t in zip(got["import"]["payloads"], ref["export"], truth["export"], strict=True):
            assert all(a.shape == b.shape and _close(a, b, c, dtype) for a, b, c in zip(x, y, t, strict=True)), where
    else:
        assert got["import"] is None, where
    if run["export"] == "on":
        for x, y, t in zip(got["export"], ref["export"], truth["export"], strict=True):
            for a, b, c in zip(x, y, t, strict=True):
                assert a.shape == b.shape and _close(a, b, c, dtype), where
        assert sorted(got["to_one"]) == _dsts(world), where
        for dst, exports in got["to_one"].items():  # exactly dst receives, what every rank gets
            for x, y in zip(exports, got["export"], strict=True):
                assert (x is None) == (rank != dst), (where, dst)
                assert x is None or all(a.equal(b) for a, b in zip(x, y, strict=True)), (where, dst)


def test_the_runs_hold_every_allowed_pair_and_no_refused_one():
    allowed, refused, implied = classify_pairs(cpu_values())
    held = set()
    for run in CPU_RUNS + DST_RUNS:
        assert refusal(run) is None, run
        held |= {tuple(sorted(p, key=lambda kv: list(AXES).index(kv[0]))) for p in combinations(run.items(), 2)}
    assert set(allowed) <= held
    assert not (held & {p for p, _ in refused}) and not (held & {p for p, _ in implied})
    # the declaration names real options and values only
    for r in REFUSALS:
        for k, vals in (r.a, r.b):
            assert set(vals) <= set(AXES[k].values), r
        assert all(v in AXES[k].values for k, v in r.instead), r


def _only_refusal(pair) -> dict[str, str]:
    """A whole configuration whose one refused pair is ``pair``."""
    (ka, va), (kb, vb) = pair
    rest = [k for k in AXES if k not in (ka, kb)]
    fixed = {}
    for combo in product(*(fixed.get(k, AXES[k].values) for k in rest)):
        s = applicable({ka: va, kb: vb, **dict(zip(rest, combo))})
        if [p for p in combinations(s.items(), 2) if refusal(dict(p))] in ([(pair[0], pair[1])], [(pair[1], pair[0])]):
            return s
    raise AssertionError(f"no configuration refuses only {pair}")


REFUSED = [(p, r) for p, r in classify_pairs()[1]]


@pytest.mark.parametrize("pair,rule", REFUSED, ids=[f"{a[1]}-{b[1]}" for (a, b), _ in REFUSED])
def test_a_refused_pair_is_one_line_naming_both_options(pair, rule, folders, tmp_path, capsys, monkeypatch):
    s = _only_refusal(pair)
    family = MODELS[s["model"]][0]
    names = [AXES[k].say(v, False, family) for k, v in pair]
    # the Python API: refused before any weight loads or ranks are asked for (an export's
    # refusal comes from export_kv on live ranks: tests/test_attn_dp.py; decode's from
    # engine.decode: tests/test_decode_compose.py; an import's from import_kv:
    # tests/test_pd_import_errors.py)
    if not {"export", "decode", "import"} & set(dict(pair)):
        with pytest.raises(ConfigError) as e:
            PrefillEngine(folders[s["model"], s["dtype"]], _runtime(s, folders), parallel=_parallel(s))
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in names) and rule.reason in msg, msg
        assert msg == rule.message(s, False, family)
    # the command line: in the flags typed, before any rank starts
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    command = ["generate", "--max-new-tokens", "2"] if "on" in (s["decode"], s["import"]) else ["prefill"]
    kv = tmp_path / "kv-in"  # (--import-kv's folder as the flags' reader lists it: its files are read later)
    kv.mkdir()
    (kv / "0.safetensors").write_bytes(b"")
    given = ["--import-kv", kv] if s["import"] == "on" else ["--input", req]
    argv = [*command, "--model", folders[s["model"], s["dtype"]], *given, "--output", tmp_path / "o.pt",
            "--dtype", s["dtype"], "--layout", s["layout"], "--graph", s["graph"], "--attention", s["attention"],
            "--kv-cache", s["kv_cache"], "--exchange", s["exchange"], "--moe", s.get("moe", "ep"),
            *(["--aux-hidden-layers", "0,1"] if s["aux"] == "on" else []),
            "--cp", "2", "--pp", str(_parallel(s).pp_size), "--tp", str(_parallel(s).tp_size),
            "--dp", str(_parallel(s).dp_size), *(["--export-kv", tmp_path / "kv"] if s["export"] == "on" else []),
            *(["--draft", _draft(folders, s["model"])] if s["draft"] == "on" else [])]
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    flags = [AXES[k].say(v, True, family) for k, v in pair]
    assert len(err.splitlines()) == 1 and all(f in err for f in flags) and rule.reason in err, err
    assert err == f"graphcp {command[0]}: error: {rule.message(s, True, family)}\n"


def test_full_graph_refusals_agree_with_the_backends():
    from graphcp.attention.backends.flashinfer import FlashInferAttention
    from graphcp.attention.backends.torch_ref import TorchAttention
    from graphcp.attention.backends.triton import TritonAttention
    from graphcp.attention.backends.trtllm import TrtllmAttention

    for name, cls in (("torch", TorchAttention), ("triton", TritonAttention), ("flashinfer", FlashInferAttention),
                      ("trtllm", TrtllmAttention)):  # trtllm: True only with static max lengths, never passed yet
        assert (refusal({"graph": "full", "attention": name}) is None) == cls.supports_full_graph, name


def test_the_readme_table_and_the_doc_are_generated():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- combinations: start -->\n", "\n<!-- combinations: end -->"
    assert readme[readme.index(start) + len(start):readme.index(end)] == readme_table(), \
        "README table out of date: python scripts/combinations_doc.py"
    assert (ROOT / "docs" / "combinations.md").read_text() == combinations_doc(), \
        "docs/combinations.md out of date: python scripts/combinations_doc.py"
