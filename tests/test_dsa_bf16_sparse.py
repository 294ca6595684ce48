"""DSA models in bfloat16 at sparse lengths (requests up to 8x index_topk), against
transformers in bfloat16 given graphcp's top-k.

End to end, bfloat16 cannot be compared with the selection free: a rounding
difference anywhere before the indexer (a TP partial sum, a matmul over other rows)
flips near-tied top-k choices, in transformers as between CP sizes of graphcp (the
selection is discontinuous; float32 parity at 1e-4 is tests/test_dsa_parity.py), and
the same holds for the MoE router's expert choice (so MoE layers route every token
to every expert here). So
each graphcp run records the selection its indexer made for every row (per layer,
request and position, gathered from every rank), transformers' indexers are replaced
by that selection, and the logits of everything else (MLA in bfloat16, the sparse
attention over the selected tokens, MoE in both layouts, the cached prefix, the
layouts, graph replay) are compared at bfloat16 tolerance. The test also checks that
every row past index_topk, in every indexer layer, was recorded, and that the
selections are a choice (not each row's last index_topk tokens).
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
from graphcp.runtime.capture.buckets import BucketSet

TOL = 2e-2
BUCKETS = BucketSet((16, 32, 64, 128, 256), padding_factor=64.0)
#: every token to every expert (8 of 8, both groups): near-tied router scores flip a
#: top-k expert choice in bfloat16 as they flip the indexer's (docs/moe.md), so the MoE
#: layer is compared on its all-experts twin; the ep exchange still splits the experts
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=8, moe_intermediate_size=32,
           n_shared_experts=1, routed_scaling_factor=2.5, n_group=2, topk_group=2)
CASES = {
    "deepseek_v32-moe": ("deepseek_v32", MOE),
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(indexer_types=["full", "shared"])),
}
LENS, PREFIX, EXT = [5, 130, 3, 40], 50, 70
#: CP size -> (case, layout, graph, moe) runs
RUNS = {
    1: [("deepseek_v32-moe", "zigzag", "off", "ep"), ("glm_moe_dsa-shared", "zigzag", "breakable", "tp")],
    2: [("deepseek_v32-moe", "zigzag", "breakable", "ep"), ("deepseek_v32-moe", "interleave", "off", "tp"),
        ("glm_moe_dsa-shared", "interleave", "breakable", "tp")],
    4: [("deepseek_v32-moe", "interleave", "breakable", "ep"), ("glm_moe_dsa-shared", "zigzag", "off", "tp")],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=5)


def _tokens():
    rng = np.random.default_rng(23)
    return [rng.integers(0, 512, n) for n in LENS], rng.integers(0, 512, PREFIX), rng.integers(0, 512, EXT)


def _record(eng: PrefillEngine) -> dict:
    """Wrap the backend's selected_blocks: every selection an indexer layer makes, by
    (layer, the request's first page, position)."""
    att = eng.parts.body.attention
    inner, records = att.selected_blocks, {}

    def selected_blocks(layer, index_q, index_w, cache, device):
        for blk in inner(layer, index_q, index_w, cache, device):
            if blk.selection is not None and index_q is not None:
                first = int(blk.pages[0])
                for p, row in zip(blk.positions.tolist(), blk.selection.cpu()):
                    records[layer, first, p] = row.clone()
            yield blk

    att.selected_blocks = selected_blocks
    return records


def _job(group, runs):
    """Each run: the prefix, then the batch extending it; (logits on rank 0, this
    rank's selections, each request's first page)."""
    out = []
    for case, folder, layout, graph, moe in runs:
        rt = RuntimeConfig(dtype="bfloat16", layout=layout, graph=graph, moe=moe, kv_tokens=2048)
        eng = PrefillEngine(folder, rt, group, BUCKETS)
        if graph != "off":
            eng.capture()  # before recording: the capture's synthetic batches select too
        records = _record(eng)
        toks, prefix, ext = _tokens()
        h = eng.prefill([Request(prefix)]).handles[0]
        o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
        assert o.info.path == ("eager" if graph == "off" else "graph"), (case, graph)
        firsts = [x.pages[0] for x in o.handles]
        out.append(([x.clone() for x in o.logits] if group.rank == 0 else None, records, firsts))
    return out


def _inject(model, records: dict, first_page: int, topk: int) -> None:
    """Replace each indexer of ``model`` by the recorded selection of the request whose
    first page is ``first_page`` (rows that see at most ``topk`` tokens: all of them,
    as transformers' own top-k over a causal mask gives)."""
    for layer, block in enumerate(model.model.layers):
        indexer = getattr(block.self_attn, "indexer", None)
        if indexer is None:  # a GLM "shared" layer: transformers reuses the last full layer's
            continue

        def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                    layer=layer):
            s, t = hidden_states.shape[1], attention_mask.shape[-1]
            k = min(topk, t)
            rows = [records[layer, first_page, p] if p >= topk else torch.arange(k) for p in range(s)]
            return torch.stack(rows).view(1, s, k).to(torch.int32)

        indexer.forward = forward


@pytest.mark.parametrize("cp", [1, 2, 4])
@torch.inference_mode()
def test_bf16_sparse_attention_matches_transformers_given_the_same_topk(cp, folders):
    from transformers import AutoModelForCausalLM

    runs = [(case, folders[case], layout, graph, moe) for case, layout, graph, moe in RUNS[cp]]
    per_rank = [_job(CPGroup(), runs)] if cp == 1 else launch(_job, cp, runs)
    toks, prefix, ext = _tokens()
    seqs = [np.concatenate([prefix, ext])] + toks
    for i, (case, folder, layout, graph, moe) in enumerate(runs):
        where = f"{case} CP {cp} {layout} graph {graph} moe {moe}"
        logits, _, firsts = per_rank[0][i]
        records = {}
        for r in per_rank:  # every rank's rows
            records.update(r[i][1])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        topk = model.config.index_topk
        sparse = 0
        for j, (seq, got) in enumerate(zip(seqs, logits)):
            _inject(model, records, firsts[j], topk)
            ref = model(input_ids=torch.from_numpy(seq).view(1, -1)).logits[0].float()[len(seq) - got.shape[0]:]
            err = rel_err(got, ref)
            assert err < TOL, f"{where}, request {j} ({len(seq)} tokens): {err:.3g} vs transformers given its top-k"
            mine = {key[2]: sel for key, sel in records.items() if key[1] == firsts[j]}
            sparse += len([key for key in records if key[1] == firsts[j]])
            last_k = sum(torch.equal(sel, torch.arange(p - topk + 1, p + 1)) for p, sel in mine.items())
            assert last_k < len(mine) or not mine, f"{where}, request {j}: every row selected its last {topk} tokens"
        indexer_layers = sum(getattr(b.self_attn, "indexer", None) is not None for b in model.model.layers)
        want = indexer_layers * sum(max(0, len(s) - topk) for s in seqs)
        assert sparse == want, f"{where}: {sparse} recorded selections, expected {want} (every sparse row, layer)"
