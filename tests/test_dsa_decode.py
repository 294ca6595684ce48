"""Decode for DSA models (DeepSeek V3.2, GLM-5) against transformers (issue 47, docs/dsa.md).

Each decode step scores the new query row against every cached indexer key of its
request, takes the top index_topk and attends over the selected latents: on the
replicated cache on every rank, on the layer-split cache on the layer's owner (its
output, and the selection a GLM 'shared' layer reuses, broadcast). Greedy decoding of a
batch of requests of mixed lengths (one past index_topk at its prefill, one crossing it
while decoding, one short) must give transformers' greedy ``generate``'s 16 token ids and
each step's logits within 1e-4 (float32), eagerly and on the decode graphs (the first
replay of each bucket self-checked), at CP 1, 2 and 4 on each cache; checkpoints with 16
indexer heads (no tie at the k-th best score), DeepSeek V3.2 with YaRN and a GLM-5 with
'shared' indexer layers and MoE (``ep``: its exchange a break of the decode graph). A
one-head indexer (ties) is compared with the single-rank engine. A three-turn
conversation matches transformers on the whole sequence. bfloat16 within 2e-2 of
transformers in bfloat16 given graphcp's selection (a bfloat16 rounding flips near-tied
top-k choices, tests/test_dsa_bf16_sparse.py). A step at the context limit is one line
that changes nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import save_cases
from helpers import hf_greedy, rel_err
from test_decode import conversation, greedy

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.cli.main import main
from graphcp.dist import CPGroup, launch
from graphcp.errors import BatchError
from graphcp.pd.files import save_kv
from graphcp.pd.hf import cache_argument
from graphcp.pd.load import load_kv

NEW = 16
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = (5, 30, 12)  # dense, sparse from its prefill, sparse from its fifth decode step (index_topk 16)
PAGE = 16
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, routed_scaling_factor=2.5)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0,
            rope_theta=10000.0)
CASES = {
    "deepseek_v32-yarn": ("deepseek_v32", dict(rope_parameters=YARN)),
    # four layers, two 'shared' ones reusing layer 1's top-k: under the layer split its owner
    # hands it to theirs (CP 2: rank 0 to rank 1; CP 4: rank 1 to ranks 2 and 3)
    "glm_moe_dsa-shared-moe": ("glm_moe_dsa", dict(MOE, num_hidden_layers=4,
                                                   indexer_types=["full", "full", "shared", "shared"])),
    # one indexer head: many keys score exactly 0, ties at the k-th best (compared with one rank)
    "deepseek_v32-ties": ("deepseek_v32", dict(index_n_heads=1)),
    # a context of 40 positions (the refused step)
    "glm_moe_dsa-short": ("glm_moe_dsa", dict(indexer_types=["full", "shared"], max_position_embeddings=40)),
}
PARITY = ("deepseek_v32-yarn", "glm_moe_dsa-shared-moe")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A GLM-5 checkpoint of one indexer layer and a 'shared' one, for bfloat16."""
    return save_cases(tmp_path_factory, {"glm-bf16": ("glm_moe_dsa", dict(indexer_types=["full", "shared"]))},
                      seed=5)["glm-bf16"]


def _prompts(lens=LENS, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n) for n in lens]


def _engine(folder, group, mode: str, dtype: str = "float32", moe: str = "ep") -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048, kv_cache=mode, graph="breakable",
                                               page_size=PAGE, moe=moe), group)


def _modes(cp: int) -> tuple[str, ...]:
    return ("replicated",) if cp == 1 else ("replicated", "layer-split")


def _refuse_at_context(eng: PrefillEngine) -> str:
    """A request at the model's context: one line, the cache (its pages and pools) unchanged."""
    ctx = eng.max_context
    h = eng.prefill([Request(np.arange(ctx - 1) % 512)]).handles[0]
    h = eng.decode([h], [1]).handles[0]  # the last position
    snap, pools = eng.parts.kv.snapshot(), {n: p.clone() for n, p in eng.parts.kv.page_pools().items()}
    try:
        eng.decode([h], [1])
    except BatchError as e:
        msg = str(e)
    else:
        raise AssertionError("a step past the context ran")
    assert eng.parts.kv.snapshot() == snap
    assert all(torch.equal(p, pools[n]) for n, p in eng.parts.kv.page_pools().items())
    eng.release(h)
    return msg


def _job(group, folders: dict, cp: int, bf16_folder) -> dict:
    out = {}
    for case in PARITY + ("deepseek_v32-ties",):
        for mode in _modes(cp):
            eng = _engine(folders[case], group, mode)
            for path in ("eager", "graph"):
                out[case, mode, path] = greedy(eng, _prompts(), NEW, path == "eager")
            if cp == 2 and case in PARITY:
                out[case, mode, "conversation"] = conversation(eng, 512)
            out[case, mode, "steps"] = eng.stats()["decode_steps"]
            out[case, mode, "stored"] = eng.parts.kv.stored_tokens()
            out[case, mode, "verified"] = set(eng.parts.decoder.graphs.verified)  # buckets whose first replay passed
    if cp <= 2:
        for mode in _modes(cp):
            out["refused", mode] = _refuse_at_context(_engine(folders["glm_moe_dsa-short"], group, mode))
            out["bfloat16", mode] = _bf16(_engine(bf16_folder, group, mode, "bfloat16", "tp"))
    return out


def _bf16(eng: PrefillEngine) -> dict:
    """Greedy bfloat16 decoding of prompts within index_topk (a dense prefill), eager and on
    the graphs, with the selection the one indexer layer made at each step (each step's
    ``[B, index_topk]``, read after it from the attention that ran it)."""
    out = {}
    for path in ("eager", "graph"):
        out[path] = _greedy_recording(eng, _prompts((9, 14, 6), seed=8), NEW, path == "eager")
    return out


def _greedy_recording(eng: PrefillEngine, prompts, steps: int, eager: bool):
    o = eng.prefill([Request(p) for p in prompts], force_eager=True)
    handles, tok = o.handles, o.last_logits.argmax(-1)
    toks, logits, selections = [tok], [o.last_logits], []
    for _ in range(steps - 1):
        o = eng.decode(handles, tok, force_eager=eager, logits=True)
        graphs = eng.parts.decoder.graphs
        att = eng.parts.body.attention if eager else graphs.attention((o.info.capacity, o.info.stats["pages"]))
        selections.append(att.selection_rows(len(handles), torch.device("cpu"))[: len(handles)].clone())
        handles, tok = o.handles, o.logits.argmax(-1)
        toks.append(tok)
        logits.append(o.logits)
    for h in handles:
        eng.release(h)
    return torch.stack(toks, 1), torch.stack(logits, 1), selections


@pytest.fixture(scope="module")
def runs(folders, bf16_folder):
    """cp -> every rank's results of :func:`_job` (CP 4 only when its test runs)."""
    got = {1: [_job(CPGroup(), folders, 1, bf16_folder)]}
    got[2] = launch(_job, 2, folders, 2, bf16_folder)
    return got


@pytest.fixture(scope="module")
def runs4(folders, bf16_folder):
    return launch(_job, 4, folders, 4, bf16_folder)


@pytest.fixture(scope="module")
def references(folders, hf_model):
    """case -> transformers' greedy generate of each prompt alone: tokens [R, NEW], logits [R, NEW, V]."""
    out = {}
    for case in PARITY:
        model = hf_model(folders[case], "float32")
        out[case] = hf_greedy(model, _prompts(), NEW)
    return out


def _check_parity(per_rank: list[dict], references: dict, cp: int) -> None:
    for case in PARITY:
        ref_tokens, ref_logits = references[case]
        for mode in _modes(cp):
            for rank, got in enumerate(per_rank):
                for path in ("eager", "graph"):
                    toks, logits, paths = got[case, mode, path]
                    where = (case, cp, mode, path, rank)
                    assert torch.equal(toks, ref_tokens), where
                    for i in range(NEW):
                        assert rel_err(logits[:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
                    assert set(paths) == {path}, where
                steps = got[case, mode, "steps"]
                assert all(s["decode_merge"] == "local" for s in steps)
                # the layer-split cache's holders broadcast each layer's output (and a selection)
                moved = sum(s["bytes_merged"] for s in steps)
                assert (moved > 0) == (mode == "layer-split"), (case, mode, moved)
                assert got[case, mode, "stored"] == 0
                # each bucket's first replay was self-checked (RuntimeConfig.verify_capture: on by default
                # on the CPU stand-in): the 4-request buckets of every page width replayed
                replayed = {(s["bucket"], s["pages"]) for s in steps if s["path"] == "graph"}
                assert replayed and got[case, mode, "verified"] == replayed, (case, mode)


def _check_ties(per_rank: list[dict], single: dict, cp: int) -> None:
    """The tie-heavy checkpoint against the single-rank engine: the same ids, logits within 1e-4."""
    want_toks, want_logits, _ = single["deepseek_v32-ties", "replicated", "eager"]
    for mode in _modes(cp):
        for path in ("eager", "graph"):
            toks, logits, _ = per_rank[0]["deepseek_v32-ties", mode, path]
            assert torch.equal(toks, want_toks), (cp, mode, path)
            assert rel_err(logits, want_logits) <= TOL["float32"], (cp, mode, path)


def test_dsa_decoding_matches_transformers_at_cp_1(runs, references):
    _check_parity(runs[1], references, 1)
    # the one-head indexer: the graph's selection equals the eager one's on one rank too
    _check_ties(runs[1], runs[1][0], 1)


def test_dsa_decoding_matches_transformers_at_cp_2(runs, references):
    _check_parity(runs[2], references, 2)
    _check_ties(runs[2], runs[1][0], 2)
    for got in runs[2][1:]:  # every rank returns the same logits
        assert torch.equal(got[PARITY[1], "layer-split", "eager"][1], runs[2][0][PARITY[1], "layer-split", "eager"][1])


@pytest.mark.slow
def test_dsa_decoding_matches_transformers_at_cp_4(runs, runs4, references):
    _check_parity(runs4, references, 4)
    _check_ties(runs4, runs[1][0], 4)


def test_a_dsa_conversation_matches_transformers_on_the_whole_sequence(runs, folders, hf_model):
    for case in PARITY:
        hf = hf_model(folders[case], "float32")
        for mode in _modes(2):
            seqs, logits, _, total = runs[2][0][case, mode, "conversation"]
            for j in range(2):
                with torch.inference_mode():
                    ref = hf(input_ids=torch.tensor(seqs[j]).view(1, -1)).logits[0].float()
                assert len(seqs[j]) > 16 and logits[j].shape == ref.shape, (case, mode, j)
                assert rel_err(logits[j], ref) <= TOL["float32"], (case, mode, j)
            assert total == [len(s) for s in seqs]


def _inject(model, selections: list[torch.Tensor], request: int, prompt: int, topk: int) -> None:
    """transformers' one indexer replaced by graphcp's selection at each decode step
    (position ``prompt + i``: step ``i``'s; rows that see at most index_topk tokens, the
    prompt's among them: all of them)."""
    indexer = model.model.layers[0].self_attn.indexer

    def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        s, t = hidden_states.shape[1], attention_mask.shape[-1]
        k = min(topk, t)
        rows = [selections[p - prompt][request][:k] if p >= topk else torch.arange(k) for p in range(s)]
        return torch.stack(rows).view(1, s, k).to(torch.int32)

    indexer.forward = forward


def test_bfloat16_decoding_matches_transformers_given_the_same_topk(runs, bf16_folder, hf_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.bfloat16).eval()
    topk = model.config.index_topk
    prompts = _prompts((9, 14, 6), seed=8)
    for cp in (1, 2):
        for mode in _modes(cp):
            for path in ("eager", "graph"):
                toks, logits, selections = runs[cp][0]["bfloat16", mode][path]
                for j, p in enumerate(prompts):
                    seq = torch.cat([torch.from_numpy(p), toks[j, :-1]]).view(1, -1)
                    assert seq.shape[1] > topk + 2  # its last steps select
                    assert (selections[-1][j] >= 0).all() and not torch.equal(
                        selections[-1][j], torch.arange(seq.shape[1] - topk, seq.shape[1]))  # a choice
                    _inject(model, selections, j, len(p), topk)
                    with torch.inference_mode():
                        ref = model(input_ids=seq).logits[0, len(p) - 1:].float()
                    assert rel_err(logits[j], ref) <= TOL["bfloat16"], (cp, mode, path, j)


def test_a_step_at_the_context_limit_is_one_line_and_changes_nothing(runs):
    for cp in (1, 2):
        for mode in _modes(cp):
            for got in runs[cp]:
                msg = got["refused", mode]
                assert "\n" not in msg and msg == ("decode: request 0 holds 40 tokens, the model's context of 40: no "
                                                    "position is left for another")


def test_graphcp_generate_matches_transformers(tmp_path, capsys, folders, references):
    """``graphcp generate --cp 2 --kv-cache layer-split``: transformers' greedy ids."""
    case = "glm_moe_dsa-shared-moe"
    rows = tmp_path / "r.jsonl"
    rows.write_text("".join(json.dumps({"tokens": p.tolist()}) + "\n" for p in _prompts()))
    out = tmp_path / "out.pt"
    argv = ["generate", "--model", str(folders[case]), "--input", str(rows), "--output", str(out), "--max-new-tokens",
            str(NEW), "--cp", "2", "--kv-cache", "layer-split", "--kv-tokens", "2048", "--page-size", str(PAGE)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "layer-split KV cache, decode path graph" in capsys.readouterr().out
    assert torch.load(out)["tokens"] == [[t.tolist()] for t in references[case][0]]


def test_the_triton_sparse_attention_decodes_as_the_reference(folders):
    """``attention="triton"`` (its kernel under the interpreter): an eager decode step
    runs it on the step's metadata, equal to the torch reference within 1e-5 (a decode
    graph captures the same static form for either backend)."""
    logits = {}
    for att in ("torch", "triton"):
        eng = PrefillEngine(folders["glm_moe_dsa-shared-moe"], RuntimeConfig(kv_tokens=1024, attention=att,
                                                                               page_size=PAGE, graph="off"))
        o = eng.prefill([Request(p) for p in _prompts()[:2]])
        handles, tok, got = o.handles, o.last_logits.argmax(-1), []
        for _ in range(2):
            o = eng.decode(handles, tok, logits=True)
            assert o.info.path == "eager"
            handles, tok = o.handles, o.logits.argmax(-1)
            got.append(o.logits)
        logits[att] = torch.stack(got)
    assert rel_err(logits["triton"], logits["torch"]) <= 1e-5


def _export_after_decoding(group, folder, path: str, prompt: np.ndarray, steps: int) -> list[int]:
    """A prefill, ``steps`` greedy decode steps on the decode graphs (layer-split cache),
    then the request's KV exported to rank 0 and written to ``path``: the sequence cached."""
    eng = _engine(folder, group, "layer-split")
    o = eng.prefill([Request(prompt)])
    handles, tok, seq = o.handles, o.last_logits.argmax(-1), prompt.tolist()
    for _ in range(steps):
        seq.append(int(tok[0]))
        o = eng.decode(handles, tok, logits=True)
        assert o.info.path == "graph"
        handles, tok = o.handles, o.logits.argmax(-1)
    export = eng.export_kv(handles[0], dst=0)
    if export is not None:
        export.token_ids = torch.tensor(seq)
        save_kv(export, path)
    eng.release(handles[0])
    return seq


def test_transformers_continues_from_the_kv_exported_after_decoding(folders, hf_model, tmp_path):
    """The cache the decode steps wrote (CP 2, layer-split, graphs), exported and loaded as
    transformers' cache: its logits for more tokens equal transformers' on the whole sequence."""
    path = str(tmp_path / "kv.safetensors")
    seq = launch(_export_after_decoding, 2, folders["glm_moe_dsa-shared-moe"], path, _prompts()[1], 9)[0]
    loaded = load_kv(path)
    assert loaded.num_tokens == len(seq) == len(_prompts()[1]) + 9
    model = hf_model(folders["glm_moe_dsa-shared-moe"], "float32")
    more = torch.tensor([[3, 77, 410, 9, 250]])
    with torch.inference_mode():
        full = model(input_ids=torch.cat([torch.tensor([seq]), more], dim=1)).logits[0, -more.shape[1]:]
        cont = model(input_ids=more, use_cache=True, **{cache_argument(model): loaded.cache}).logits[0]
    assert rel_err(cont, full) < TOL["float32"]


@pytest.mark.parametrize("lens,padding", [((3, 16, 17, 40, 70), 2), ((3, 5), 1)], ids=["wide", "narrower-than-topk"])
def test_the_decode_graph_form_equals_the_reference_on_random_caches(lens, padding):
    """PagedSparseMlaDecode (what a decode graph captures) against TorchSparseMla (the
    eager step) on one decode step's metadata over random paged caches (pages out of
    order): requests below, at and past index_topk, a GLM 'shared' layer reusing layer 0's
    selection, the bucket's padding rows (zeros), and a bucket narrower than index_topk
    (its selection -1 padded): float32 within 1e-5."""
    from graphcp.attention.base import AttentionMetadata
    from graphcp.kv.layers import HeldLayers
    from graphcp.kv.spec import PoolSpec
    from graphcp.model.dsa.cache import MlaGeometry, MlaStorage
    from graphcp.model.dsa.sparse import SparseMlaSpec, TorchSparseMla
    from graphcp.model.dsa.sparse_decode import PagedSparseMlaDecode

    sp = SparseMlaSpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, kv_lora_rank=32,
                       index_heads=16, index_head_dim=16, index_topk=8, softmax_scale=0.3, num_indexer_layers=1,
                       carries=frozenset({0}))
    page, g, rng = 4, torch.Generator().manual_seed(1), np.random.default_rng(1)
    need = sum(-(-n // page) for n in lens)
    cache = MlaStorage(MlaGeometry(sp.kv_lora_rank, sp.qk_rope_head_dim, sp.index_head_dim, (True, False)),
                       PoolSpec(range(2), need + 1, page, torch.float32), HeldLayers(range(2), range(2)))
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=g))
    cache.index_pool.copy_(torch.randn(cache.index_pool.shape, generator=g))
    free, width, table = rng.permutation(np.arange(1, need + 1)), max(-(-n // page) for n in lens), []
    for n in lens:
        pages, free = free[: -(-n // page)], free[-(-n // page):]
        table.append(np.pad(pages, (0, width - pages.size)))
    R, B = len(lens), len(lens) + padding  # the bucket's rows: the step's and padding
    live = AttentionMetadata.from_host(np.arange(R + 1), np.array(lens), np.stack(table), page)
    bucket = np.zeros((B, width), dtype=np.int32)
    bucket[:R] = np.stack(table)
    host = (np.arange(B + 1, dtype=np.int32), np.r_[lens, [0] * padding].astype(np.int32), bucket)
    static = AttentionMetadata(*host, page, 1, width * page, "cpu", device_tensors=tuple(map(torch.from_numpy, host)))
    q = torch.randn(B, sp.num_heads, sp.qk_head_dim, generator=g)
    index_q, index_w = torch.randn(B, sp.index_heads, sp.index_head_dim, generator=g), torch.randn(B, sp.index_heads)
    kv_b = torch.randn(sp.num_heads * (sp.qk_nope_head_dim + sp.v_head_dim), sp.kv_lora_rank, generator=g) * 0.2
    reference, graph_form = TorchSparseMla(sp), PagedSparseMlaDecode(sp, static)
    reference.prepare(live)
    graph_form.prepare(live)  # (ignored: it reads its bucket's static metadata)
    for layer, (iq, iw) in enumerate(((index_q, index_w), (None, None))):
        want = torch.full((R, sp.num_heads, sp.v_head_dim), float("nan"))
        reference.forward(layer, q[:R], None if iq is None else iq[:R], None if iw is None else iw[:R], kv_b, cache,
                          want)
        got = torch.full((B, sp.num_heads, sp.v_head_dim), float("nan"))
        graph_form.forward(layer, q, iq, iw, kv_b, cache, got)
        assert rel_err(got[:R], want) <= 1e-5, layer
        assert torch.equal(got[R:], torch.zeros_like(got[R:])), layer  # padding rows
    # the selection a shared layer reuses (and a layer-split holder broadcasts): the reference's for scored rows
    scored = [j for j, n in enumerate(lens) if n > sp.index_topk]
    sel = graph_form.selection_rows(B, torch.device("cpu"))
    assert torch.equal(sel[scored], reference.selection_rows(R, torch.device("cpu"))[scored])
    assert (sel[R:] == -1).all()
