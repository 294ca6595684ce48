"""Decode through pipeline stages (issue 47, docs/pipeline.md "Decode"): a step's rows go
from stage to stage over the prefill's links, each stage reserves the step in its own cache,
and the last stage's logits reach every rank. Greedy decoding of a batch of mixed lengths
over 16 new tokens equals the single-rank engine (the same ids; every step's logits within
1e-4 in float32; in bfloat16, where a near-tie may round either way, every step's logits
within the suite's 2e-2 on the reference's sequence), at PP 2 x CP 1 and PP 2 x CP 2 on every
cache mode, eagerly and on decode graphs (each bucket's first replay self-checked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch

LENS = (7, 29, 1)
NEW = 16
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def greedy(engine: PrefillEngine, force_eager: bool, forced: torch.Tensor | None = None):
    """A prefill of LENS, then NEW - 1 decode steps of the greedy token (``forced`` [R, NEW]:
    these tokens instead): tokens [R, NEW], logits [R, NEW, V], each step's path; the KV released."""
    rng = np.random.default_rng(3)
    out = engine.prefill([Request(rng.integers(0, engine.cfg.vocab_size, n)) for n in LENS], force_eager=True)
    handles, logits, toks, paths = out.handles, [out.last_logits], [out.last_logits.argmax(-1)], []
    for _ in range(NEW - 1):
        o = engine.decode(handles, toks[-1], force_eager=force_eager, logits=True)
        assert np.array_equal(o.tokens, o.logits.argmax(-1).numpy())
        handles, paths = o.handles, paths + [o.info.path]
        logits.append(o.logits)
        toks.append(o.logits.argmax(-1) if forced is None else forced[:, len(toks)])
    for h in handles:
        engine.release(h)
    return torch.stack(toks, 1), torch.stack(logits, 1), paths


def _job(group, folder, dtype, cp, modes, forced) -> dict:
    out = {}
    for mode in modes:
        for graph in ("off", "breakable"):
            rt = RuntimeConfig(kv_tokens=512, kv_cache=mode, dtype=dtype, graph=graph)
            engine = PrefillEngine(folder, rt, group, parallel=ParallelConfig(cp_size=cp, pp_size=2))
            toks, logits, paths = greedy(engine, graph == "off", forced)
            checked = [] if engine.parts.runner is None else sorted(engine.parts.decoder.graphs.verified)
            out[mode, graph] = (toks, logits, paths, checked, engine.stats()["decode_steps"][-1])
    return out


def _check(folder, dtype, cp, modes) -> None:
    want_t, want_l, _ = greedy(PrefillEngine(folder, RuntimeConfig(kv_tokens=512, dtype=dtype)), True)
    forced = None if dtype == "float32" else want_t
    for rank, got in enumerate(launch(_job, 2 * cp, folder, dtype, cp, modes, forced)):
        for (mode, graph), (toks, logits, paths, checked, last) in got.items():
            where = (rank, mode, graph)
            assert torch.equal(toks, want_t), where  # (bfloat16: fed the reference's)
            assert rel_err(logits, want_l) <= TOL[dtype], (where, rel_err(logits, want_l))
            assert last["pipeline"]["stages"] == 2 and last["pipeline"]["stage"] == rank // cp, where
            if graph == "off":
                assert set(paths) == {"eager"}, where
            else:  # every step replayed, each bucket's first replay self-checked
                assert set(paths) == {"graph"} and checked, where


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: hf_model_dir("qwen3", False, dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pp2_cp1_decode_equals_one_rank(folders, dtype):
    _check(folders[dtype], dtype, 1, ("replicated",))


def test_pp2_cp2_decode_equals_one_rank(folders):
    _check(folders["float32"], "float32", 2, ("sharded", "layer-split"))


@pytest.mark.parametrize("family", ["qwen3_5_text", "deepseek_v4"])
def test_a_hybrid_and_deepseek_v4_decode_through_stages(hf_model_dir, family):
    """A hybrid's linear layers step their states on the stage holding them; V4 hands its
    hc_mult residual streams on."""
    _check(hf_model_dir(family), "float32", 1, ("replicated",))
