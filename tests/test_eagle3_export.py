"""A request prefilled with an EAGLE-3 draft exports its draft layer's K/V after the
target's (graphcp-kv/1 with ``draft_layers=1``), from every cache mode at CP 2 (graphs off and breakable), and the
export continues exactly in the reference: the target's layers in transformers' cache
give the next token's logits, the draft's K/V are the reference draft's and a next
draft step over them equals the reference over the whole sequence. The file transport
keeps the draft layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle3_ref import LAYER_IDS, eagle3_reference, shifted, target_states, write_draft, write_target
from helpers import rel_err

from graphcp import ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.dist import launch
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.hf import greedy_continue, to_dynamic_cache
from graphcp.runtime.engine import prefill_after_prefixes

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
CASES = [("replicated", "float32", "off"), ("sharded", "float32", "breakable"), ("layer-split", "float32", "off"),
         ("layer-split", "bfloat16", "breakable"), ("sharded", "bfloat16", "off")]
PREFIX, NEW = 11, 18


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3x")
    return str(write_target(root / "target")), str(write_draft(root / "draft"))


def _ids():
    return np.random.default_rng(5).integers(0, 512, PREFIX + NEW)


def _job(group, target, draft, path):
    out = []
    ids = _ids()
    for kv, dtype, graph in CASES:
        rt = RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=kv, draft=draft, graph=graph)
        eng = PrefillEngine(target, rt, group, None, ParallelConfig(cp_size=2))
        res = prefill_after_prefixes(eng, [(ids[:PREFIX], ids[PREFIX:])])
        export = eng.export_kv(res.handles[0])
        assert res.info.path == ("graph" if graph != "off" else "eager")
        if group.rank == 0 and kv == "layer-split":
            save_kv(export, f"{path}/{dtype}.safetensors")
        out.append((export, int(res.draft.next_tokens[0]), res.draft.logits[0]))
    return out


def test_the_export_continues_in_the_reference(models, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target, draft = models
    w = load_file(f"{draft}/model.safetensors")
    ids = _ids()
    hf = {d: AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, d)).eval() for d in TOL}
    for rank, per_case in enumerate(launch(_job, 2, target, draft, str(tmp_path))):
        for (kv, dtype, _), (export, nxt, draft_logits) in zip(CASES, per_case):
            where, tol, m = f"rank {rank}: {kv}, {dtype}", TOL[dtype], export.meta
            assert (m.num_layers, m.draft_layers, m.target_layers) == (5, 1, 4), where
            embed = hf[dtype].model.embed_tokens.weight.detach()
            # the draft's K/V: the reference's over the whole request
            h3, _ = target_states(hf[dtype], ids)
            _, _, (k, v) = eagle3_reference(w, embed, h3, shifted(ids, nxt))
            assert rel_err(export.k[4], k.transpose(0, 1)) <= tol, where
            assert rel_err(export.v[4], v.transpose(0, 1)) <= tol, where
            # the target continues: its layers in transformers' cache, the next token fed
            _, first = greedy_continue(hf[dtype], to_dynamic_cache(export), nxt, 1)
            h3_next, logits = target_states(hf[dtype], np.append(ids, nxt))
            assert rel_err(first, logits[-1]) <= tol, where
            # the draft continues: one step at position T over the exported K/V equals the
            # reference over the whole sequence (the next token's input: the draft's own guess)
            guess = int(torch.arange(128)[draft_logits.argmax()] + w["d2t"][draft_logits.argmax()])
            past = (export.k[4].transpose(0, 1).to(h3.dtype), export.v[4].transpose(0, 1).to(h3.dtype))
            step, _, _ = eagle3_reference(w, embed, h3_next[-1:], torch.tensor([guess]), start=len(ids), past=past)
            whole, _, _ = eagle3_reference(w, embed, h3_next, shifted(np.append(ids, nxt), guess))
            assert rel_err(step[0], whole[-1]) <= tol, where
            assert rel_err(draft_logits, whole[-2]) <= tol, where
    for dtype in TOL:  # the file transport keeps the draft's layer and says which it is
        back = read_kv(tmp_path / f"{dtype}.safetensors")
        assert back.meta.draft_layers == 1 and len(back.k) == 5
        assert len(to_dynamic_cache(back).layers) == 4
    assert LAYER_IDS == (2, 0, 1)
