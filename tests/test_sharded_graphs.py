"""Breakable graphs with a sharded cache: the ring runs in the attention break with
the live batch's metadata, and a replay equals the same body run eagerly on the
same bucket bitwise (float32 and bfloat16, pass-KV and pass-Q, a cached sharded
prefix, both sides of a bucket boundary); once a batch of a size has run, replays
of it allocate none of the ring's buffers; bytes received are counted on the graph
path too (the replicated all-gather's, captured inside segments, as well)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.attention.exchange import exchanged_bytes_per_layer
from graphcp.attention.ring.hardware import measure_link_gb_per_s
from graphcp.dist import launch
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.runtime.capture.buckets import BucketSet

BUCKETS = BucketSet((16, 32, 64, 128), padding_factor=64.0)
UNPADDED_TOL = {"float32": 1e-6, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def model(hf_model_dir):
    """The tiny tied Qwen3 checkpoint: the default preset's family at a sixteenth of its work."""
    return hf_model_dir("qwen3", True)


def _job(group, model):
    report = []
    for dtype in ("float32", "bfloat16"):
        for exchange in ("pass-kv", "pass-q"):
            eng = PrefillEngine(model, RuntimeConfig(dtype=dtype, graph="breakable", kv_tokens=4096,
                                                     kv_cache="sharded", exchange=exchange, debug_graphs=True),
                                group, BUCKETS)
            eng.capture()  # each bucket self-checked (the trace backend's default)
            rng = np.random.default_rng(5)
            vocab = eng.cfg.vocab_size
            prefix = eng.prefill([Request(rng.integers(0, vocab, 45))]).handles[0]
            cp = group.size
            for lens, with_prefix in (([200, 1, 2 * cp - 1], True), ([cp * 64], False), ([cp * 64 + cp], False)):
                reqs = [Request(rng.integers(0, vocab, n), prefix if with_prefix and j == 0 else None)
                        for j, n in enumerate(lens)]
                prep = eng.parts.preparer.prepare(reqs)
                sel = eng.parts.runner.select(prep.plan.max_local_rows)
                same = eng.parts.runner.eager_on_bucket(prep, sel.capacity).clone()
                prep.stats.clear()
                unpadded = eng.parts.body.eager(prep, prep.plan.max_local_rows).clone()
                eager_received = prep.stats.get(KV_RECEIVED, 0)
                prep.stats.clear()
                allocs = eng.parts.body.exchange.ring.buffers.allocations
                hidden, info = eng.parts.runner.try_replay(prep)
                n = prep.ids.shape[0]
                report.append((dtype, exchange, sel.capacity, info.path, bool(torch.equal(hidden, same)),
                               rel_err(hidden[:n], unpadded[:n]), eng.parts.body.exchange.ring.buffers.allocations - allocs,
                               (prep.stats.get(KV_RECEIVED, 0), eager_received), prep.kv_plan.exchange))
                eng.parts.preparer.abort(prep)
            eng.release(prefix)
    # the replicated cache's all-gather runs inside the captured segments: counted once at
    # capture, added to every replay (the whole bucket's rows travel)
    rep = PrefillEngine(model, RuntimeConfig(graph="breakable", kv_tokens=4096, verify_capture=False), group,
                        BucketSet((64,), padding_factor=64.0))
    out = rep.prefill([Request(np.arange(70) % 100)])
    cfg = rep.cfg
    want = cfg.num_layers * exchanged_bytes_per_layer(64, group.size, cfg.num_kv_heads, cfg.head_dim, 4)
    link = measure_link_gb_per_s(group, nbytes=1 << 20, repeats=1)  # the helper for --link-gb-per-s
    return report, (out.info.path, out.info.stats["bytes_received"], want, out.info.stats["exchange"]), link


def test_replay_with_a_sharded_cache_equals_the_same_bucket_eager_body(model):
    for rank, (report, replicated, link) in enumerate(launch(_job, 2, model)):
        assert link > 0
        path, received, want, exchange = replicated
        assert path == "graph" and exchange == "all-gather" and received == want > 0, replicated
        caps = [r[2] for r in report]
        assert caps[:3] == [128, 64, 128]  # 64 local rows | 65: both sides of a boundary
        for dtype, exchange, cap, path, bitwise, err, allocs, received, ran in report:
            where = f"rank {rank}, {dtype}, {exchange}, bucket {cap}"
            assert path == "graph" and ran == exchange, where
            assert bitwise, f"{where}: the replay differs from the same-bucket eager body"
            assert err <= UNPADDED_TOL[dtype], f"{where}: {err}"
            assert allocs == 0, f"{where}: the replay allocated {allocs} ring buffers"
            assert received[0] == received[1] > 0, (where, received)  # the replay's ring moved what eager's did


def _fresh_replays(group, model):
    """Buckets captured, then batches that never ran before (the largest bucket's rows,
    a long cached prefix): the replays' ring breaks allocate no buffer."""
    out = []
    for exchange in ("auto", "pass-kv", "pass-q"):
        eng = PrefillEngine(model, RuntimeConfig(graph="breakable", kv_tokens=4096, kv_cache="sharded",
                                                 exchange=exchange, verify_capture=False), group, BUCKETS)
        eng.capture()
        reserved = eng.parts.body.exchange.ring.buffers.allocations
        rng = np.random.default_rng(9)
        vocab = eng.cfg.vocab_size
        # a prefix (its pages travel in pass-KV's messages), then extends up to the largest bucket
        first = eng.prefill([Request(rng.integers(0, vocab, 250))])
        prefix = first.handles[0]
        after_prefix = eng.parts.body.exchange.ring.buffers.allocations
        paths = [(first.info.path, first.info.stats["exchange"])]
        for lens in ([128 * group.size - 5], [200, 3, 1], [64 * group.size + 1]):
            reqs = [Request(rng.integers(0, vocab, n), prefix if j == 0 else None) for j, n in enumerate(lens)]
            o = eng.prefill(reqs)
            paths.append((o.info.path, o.info.stats["exchange"]))
            prefix = o.handles[0]
            for h in o.handles[1:]:
                eng.release(h)
        out.append((exchange, reserved, after_prefix, eng.parts.body.exchange.ring.buffers.allocations, paths))
    return out


def test_ring_buffers_are_reserved_per_bucket_at_capture(model):
    for rank, results in enumerate(launch(_fresh_replays, 2, model)):
        for exchange, reserved, after_prefix, after, paths in results:
            where = (rank, exchange, paths)
            assert reserved > 0, where  # allocated at capture
            assert all(p == "graph" for p, _ in paths), where
            assert exchange == "auto" or all(e == exchange for _, e in paths), where
            assert after == after_prefix == reserved, where  # no replay allocated a ring buffer
