"""--graph full: attention (the triton kernel, under the Triton interpreter on
CPU) is captured inside the graph; replay equals the same-bucket eager body
bitwise and the eager forward within rounding at CP = 2, float32 and bfloat16; the
KV the captured segments wrote exports as the eager engine's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from cp_utils import rel_err  # noqa: E402

from graphcp import PrefillEngine, Request  # noqa: E402
from graphcp.config import RuntimeConfig  # noqa: E402
from graphcp.dist import launch  # noqa: E402
from graphcp.runtime.capture.buckets import BucketSet  # noqa: E402

BUCKETS = BucketSet((16, 64), padding_factor=16.0)
#: triton vs the torch reference, and padded vs unpadded rows: rounding only
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    """The tiny Qwen3 checkpoint (explicit head_dim, q/k norms, GQA): the interpreted
    kernel's cost grows with heads x rows x layers, and the default preset has 4x them."""
    return hf_model_dir("qwen3")


def _job(group, folder, graph: str, dtype: str):
    # the reference runs the torch attention eagerly: full graph + triton must equal it
    attention = "triton" if graph == "full" else "torch"
    # the comparisons below are the self-check's, done here on the test's own batches
    # (the interpreted kernel makes a second, synthetic check per bucket slow)
    rt = RuntimeConfig(graph=graph, attention=attention, kv_tokens=2048, max_requests=4, debug_graphs=True,
                       dtype=dtype, verify_capture=False)
    eng = PrefillEngine(folder, rt, group, BUCKETS)
    if eng.parts.runner is not None:
        eng.capture()  # before the same-bucket comparisons (see tests/test_graph_runner.py)
    rng, vocab = np.random.default_rng(5), eng.cfg.vocab_size
    out = []
    for lens, prefix in (([40, 3, 1], 0), ([90], 17)):
        h = eng.prefill([Request(rng.integers(0, vocab, prefix))]).handles[0] if prefix else None
        reqs = [Request(rng.integers(0, vocab, n), h if i == 0 else None) for i, n in enumerate(lens)]
        bitwise = None
        if eng.parts.runner is not None:  # replay vs the same body run eagerly on the same bucket
            prep = eng.parts.preparer.prepare(reqs)
            cap = eng.parts.runner.select(prep.plan.max_local_rows).capacity
            same_bucket = eng.parts.runner.eager_on_bucket(prep, cap).clone()
            hidden, _ = eng.parts.runner.try_replay(prep)
            bitwise = bool(torch.equal(hidden, same_bucket))
            eng.parts.preparer.abort(prep)
        o = eng.prefill(reqs, all_logits=True)
        segs = [g.graph.breaks for g in eng.parts.runner.graphs.values()] if eng.parts.runner else []
        export = eng.export_kv(o.handles[0])  # the KV the captured segments wrote, as a decode side gets it
        out.append((o.info.path, o.last_logits, o.logits, [len(b) for b in segs], bitwise, export.k + export.v))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_graph_replay_equals_eager_cp2(dtype, tiny):
    full = launch(_job, 2, tiny, "full", dtype)
    eager = launch(_job, 2, tiny, "off", dtype)
    for rank in range(2):
        for (path, last, logits, breaks, bitwise, kv), (epath, elast, elogits, _, _, ekv) in zip(full[rank],
                                                                                            eager[rank]):
            assert path == "graph" and epath == "eager"
            # PD export after a full-graph forward: the eager engine's K/V (a prefix extended, too)
            assert len(kv) == len(ekv) and all(rel_err(a, b) <= TOL[dtype] for a, b in zip(kv, ekv))
            assert all(b == 0 for b in breaks)  # attention inside the graph: no breaks
            assert bitwise, "full-graph replay differs from the same-bucket eager body"
            assert rel_err(last, elast) <= TOL[dtype]
            for a, b in zip(logits, elogits):
                assert rel_err(a, b) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_in_breakable_mode_matches_torch(dtype, tiny):
    a = PrefillEngine(tiny, RuntimeConfig(graph="breakable", attention="triton", kv_tokens=2048,
                                               max_requests=4, dtype=dtype, verify_capture=False), None, BUCKETS)
    b = PrefillEngine(tiny, RuntimeConfig(kv_tokens=2048, dtype=dtype))
    toks = [np.arange(50), np.arange(7) + 100]
    a.capture()
    prep = a.parts.preparer.prepare([Request(t) for t in toks])
    same_bucket = a.parts.runner.eager_on_bucket(prep, 64).clone()
    hidden, info = a.parts.runner.try_replay(prep)
    assert info.capacity == 64 and torch.equal(hidden, same_bucket)
    a.parts.preparer.abort(prep)
    x = a.prefill([Request(t) for t in toks]).last_logits
    y = b.prefill([Request(t) for t in toks]).last_logits
    assert rel_err(x, y) <= TOL[dtype]
    assert torch.isfinite(x).all()


def test_more_requests_than_static_segments_fall_back_in_full_mode():
    from graphcp.runtime.capture.buckets import FALLBACK_REQUESTS

    full = PrefillEngine("default", RuntimeConfig(graph="full", attention="triton", kv_tokens=1024, max_requests=1),
                         None, BucketSet((16,), padding_factor=16.0))
    reqs = [Request(np.arange(3)), Request(np.arange(4) + 9)]
    out = full.prefill(reqs)
    assert out.info.path == "eager" and out.info.fallback == FALLBACK_REQUESTS
    ref = PrefillEngine("default", RuntimeConfig(kv_tokens=1024)).prefill(reqs)
    assert rel_err(out.last_logits, ref.last_logits) <= 1e-5
    # breakable graphs read live metadata: any number of requests replays
    brk = PrefillEngine("default", RuntimeConfig(graph="breakable", kv_tokens=1024, max_requests=1), None,
                        BucketSet((16,), padding_factor=16.0))
    out = brk.prefill(reqs)
    assert out.info.path == "graph" and rel_err(out.last_logits, ref.last_logits) <= 1e-6
