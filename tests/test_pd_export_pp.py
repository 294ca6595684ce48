"""KV export under pipeline stages: each stage's CP group assembles its own layers and
every stage's layers reach the receivers, so the export equals transformers' own cache
(float32 and bfloat16, PP 2 x CP 1 and 2, graphs off and breakable, 1 to 3 micro-batches,
a request extending a cached prefix) and the single-rank engine's export; every rank
assembles the same bits; the CLI's export files appear only once every rank's part is
in, and a rank that fails during the export ends the others within the timeout, leaving
no file behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.cli.commands import staging_beside, write_outputs
from graphcp.cli.jobs import export_files
from graphcp.cli.requests import FileRequest
from graphcp.dist import RankFailure, launch
from graphcp.errors import InputError

LAYERS = 4  # two a stage
LENS = [37, 6]
HF_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # vs transformers (as the parity tests)
ONE_RANK_TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # vs the single-rank engine (other matmul shapes)


def _tokens(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, n) for n in LENS]


def _export_job(group, folder, dtype, cp, microbatches, graph):
    rt = RuntimeConfig(dtype=dtype, kv_tokens=512, microbatches=microbatches, graph=graph, verify_capture=False)
    eng = PrefillEngine(folder, rt, group, parallel=ParallelConfig(cp_size=cp, pp_size=2))
    toks = _tokens(eng.cfg.vocab_size)
    # request 0 in two chunks: its first 20 tokens cached by an earlier forward
    first = eng.prefill([Request(toks[0][:20])]).handles[0]
    out = eng.prefill([Request(toks[0][20:], prefix=first), Request(toks[1])])
    to_all = eng.export_kv_batch(out.handles)
    last = eng.world.size - 1
    to_last = eng.export_kv_batch(out.handles, dst=last)
    try:
        eng.export_kv(out.handles[0], dst=eng.world.size)
        bad_dst = None
    except InputError as e:
        bad_dst = str(e)
    return eng.world_rank, to_all, to_last, bad_dst


def _one_rank(folder, dtype):
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=512))
    toks = _tokens(eng.cfg.vocab_size)
    first = eng.prefill([Request(toks[0][:20])]).handles[0]
    out = eng.prefill([Request(toks[0][20:], prefix=first), Request(toks[1])])
    return eng.export_kv_batch(out.handles), toks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("cp,cases", [
    (1, [("float32", 1, "off"), ("bfloat16", 3, "off"), ("float32", 2, "breakable"), ("bfloat16", 1, "breakable")]),
    (2, [("float32", 1, "breakable"), ("bfloat16", 2, "off")]),
])
def test_export_with_pipeline_stages_equals_transformers_cache(hf_model_dir, hf_model, cp, cases):
    for dtype, microbatches, graph in cases:
        folder = hf_model_dir("llama", False, dtype, num_hidden_layers=LAYERS)
        ranks = launch(_export_job, 2 * cp, folder, dtype, cp, microbatches, graph)
        one, toks = _one_rank(folder, dtype)
        model = hf_model(folder, dtype)
        ref_all = ranks[0][1]
        for world_rank, to_all, to_last, bad_dst in ranks:
            assert to_all is not None and len(to_all) == 2
            for e, r in zip(to_all, ref_all):  # every rank assembled the same bits
                assert e.meta == r.meta and all(torch.equal(x, y) for x, y in zip(e.k + e.v, r.k + r.v))
            if world_rank == 2 * cp - 1:
                assert all(torch.equal(x, y) for e, r in zip(to_last, ref_all) for x, y in zip(e.k + e.v, r.k + r.v))
            else:
                assert to_last == [None, None]
            assert bad_dst is not None and "dst" in bad_dst and str(2 * cp) in bad_dst, bad_dst
        for i, (e, o) in enumerate(zip(ref_all, one)):
            assert e.meta.num_layers == LAYERS and e.meta.num_tokens == LENS[i]
            with torch.inference_mode():
                hf = model(input_ids=torch.as_tensor(toks[i]).view(1, -1), use_cache=True)
            cache = hf.past_key_values
            for layer in range(LAYERS):  # every stage's layers, none left uninitialised
                for got, want, mine in ((e.k[layer], cache.layers[layer].keys[0], o.k[layer]),
                                        (e.v[layer], cache.layers[layer].values[0], o.v[layer])):
                    assert torch.isfinite(got).all()
                    assert _rel(got, want) < HF_TOL[dtype], (dtype, microbatches, graph, i, layer)
                    assert _rel(got, mine) < ONE_RANK_TOL[dtype], (dtype, microbatches, graph, i, layer)


def _files_job(group, folder, out_dir, fail_rank):
    rt = RuntimeConfig(kv_tokens=512, collective_timeout_s=5.0)
    eng = PrefillEngine(folder, rt, group, parallel=ParallelConfig(cp_size=1, pp_size=2))
    toks = _tokens(eng.cfg.vocab_size)
    reqs = [FileRequest([int(t) for t in x]) for x in toks]
    out = eng.prefill([Request(r.tokens) for r in reqs])
    if eng.world_rank == fail_rank:
        def broken(handle, span):
            raise RuntimeError(f"injected read failure on global rank {fail_rank}")
        eng.parts.kv.read_span = broken
    export_files(eng, out, reqs, out_dir)
    return eng.world_rank


def test_export_files_appear_only_when_every_stage_sent_its_layers(hf_model_dir, tmp_path):
    folder = hf_model_dir("llama", False, "float32", num_hidden_layers=LAYERS)
    done = tmp_path / "kv"
    with staging_beside(str(done)) as staging:  # as graphcp prefill --export-kv does
        launch(_files_job, 2, folder, staging, -1, timeout_s=60)
        write_outputs({}, {str(done): staging})
    assert sorted(p.name for p in done.iterdir()) == ["0.safetensors", "1.safetensors"]
    from graphcp.pd.files import read_kv

    back = read_kv(done / "0.safetensors")
    assert back.meta.num_layers == LAYERS and all(torch.isfinite(t).all() for t in back.k + back.v)
    # a stage-1 rank fails while exporting: rank 0 gives up within the timeout and no
    # file (nor its staging folder) is left behind
    failed = tmp_path / "failed"
    with staging_beside(str(failed)) as staging:
        with pytest.raises(RankFailure, match="rank 1 failed first: RuntimeError: injected read failure"):
            launch(_files_job, 2, folder, staging, 1, timeout_s=5.0)
    assert not failed.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]

