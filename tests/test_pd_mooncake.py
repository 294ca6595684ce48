"""The Mooncake transport on loopback TCP: prefill ranks (forked) send to a receiver
process (forked). A batch of mixed lengths from 2 ranks, with the replicated, the
layer-split and the token-sharded cache, arrives bitwise equal to ``export_kv``, and so
it does from every rank of a run under pipeline stages and under attention TP (each
rank its own layers and KV heads); each
fault ends in its documented error within the timeout, nothing is handed out
partially, and the prefill side's KV can still be exported (and sent again) afterwards."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import numpy as np
import pytest
import torch

from graphcp import ConfigError, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import free_port, launch
from graphcp.pd.errors import TransferError
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.mooncake import mooncake_problem

PROBLEM = mooncake_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"Mooncake transport unavailable: {PROBLEM}")

LENS = [300, 1, 77, 16]
#: the sharded cache's spans are runs of positions: written one run per head
MODES = ("replicated", "layer-split", "sharded")
TIMEOUT = 3.0  # the fault tests' timeout on both sides


def _receiver_main(kind, ready, done, stop, folder, ids, timeout_s):
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    from graphcp.pd.receiver import KVReceiver

    class BadAddressOnce(KVReceiver):  # the first request's region lies outside the registered buffer
        faulty = True

        def _open(self, ch, rid, msg):
            reply = super()._open(ch, rid, msg)
            if reply["op"] == "region" and self.faulty:
                self.faulty = False
                reply["addr"] += 1 << 40
            return reply

    class NeverAcks(KVReceiver):  # swallows every "done" and tells the senders nothing after the region
        def _handle(self, ch, msg):
            if msg.get("op") != "done":
                super()._handle(ch, msg)

        def _notify(self, req, rid, **msg):
            pass

    class DiesAfterOpen(KVReceiver):  # answers the first open, then the process dies
        def _handle(self, ch, msg):
            super()._handle(ch, msg)
            if msg.get("op") == "open":
                os._exit(3)

    cls = {"good": KVReceiver, "bad-address": BadAddressOnce, "never-acks": NeverAcks,
           "dies": DiesAfterOpen}[kind]
    rx = cls(64 << 20, timeout_s=timeout_s)
    ready.put(rx.address)
    results = {}
    for rid in ids:
        try:
            save_kv(rx.get(rid, timeout_s=timeout_s + 60), os.path.join(folder, f"{rid}.safetensors"))
            results[rid] = ("ok", "")
        except TransferError as e:
            results[rid] = (type(e).__name__, str(e))
    results["completed"] = rx.completed()
    done.put(pickle.dumps(results))
    stop.wait(120)  # alive (its connections open) until the test has read the results


class Receiver:
    """A receiver process of ``kind``; ``results()`` waits for what it made of ``ids``."""

    def __init__(self, kind, folder, ids, timeout_s=TIMEOUT):
        ctx = mp.get_context("fork")
        self.ready, self.done, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_receiver_main,
                                args=(kind, self.ready, self.done, self.stop, str(folder), ids, timeout_s))
        self.proc.start()
        self.address = self.ready.get(timeout=120)

    def results(self):
        try:
            return pickle.loads(self.done.get(timeout=120))
        finally:
            self.stop.set()
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()


def _requests(vocab):
    rng = np.random.default_rng(5)
    return [Request(rng.integers(0, vocab, n)) for n in LENS]


def _send_batch(group, folder, address):
    from graphcp.pd.sender import KVSender

    out = {}
    for mode in MODES:
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode), group)
        handles = eng.prefill(_requests(eng.cfg.vocab_size)).handles
        if mode == "sharded":  # a second chunk: each rank's positions in several runs
            handles = eng.prefill([Request([7, 8, 9, 10, 11], h) for h in handles]).handles
        sender = KVSender(address, group.rank, group.size, timeout_s=60)
        sender.send(eng, handles, [f"{mode}-{i}" for i in range(len(handles))])
        sender.close()
        exports = eng.export_kv_batch(handles, dst=0)  # every rank takes part; rank 0 gets them
        out[mode] = [(e.k, e.v) for e in exports] if group.rank == 0 else None
    return out


def test_two_ranks_send_a_mixed_batch_bitwise(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"{m}-{i}" for m in MODES for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    sent = launch(_send_batch, 2, folder, rx.address)[0]
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    for mode, exports in sent.items():
        for i, (k, v) in enumerate(exports):
            recv = read_kv(tmp_path / f"{mode}-{i}.safetensors")
            assert recv.meta.num_tokens == LENS[i] + 5 * (mode == "sharded") and recv.meta.num_layers == 4
            assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), (mode, i)


#: the pipeline test's dtype per cache mode: both dtypes' bytes travel
PP_DTYPES = {"replicated": "float32", "layer-split": "bfloat16", "sharded": "bfloat16"}


def _send_pp(group, folder, address):
    """PP 2 x CP 2, every cache mode: each rank of each stage sends the spans it owns of
    its stage's layers; a sender named for another rank is refused."""
    from graphcp.pd.sender import KVSender

    out, refused = {}, None
    for mode in MODES:
        dtype = PP_DTYPES[mode]
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode, dtype=dtype), group,
                            parallel=ParallelConfig(cp_size=2, pp_size=2))
        handles = eng.prefill(_requests(eng.cfg.vocab_size)).handles
        if mode == "replicated":
            wrong = KVSender(address, 0, 1, timeout_s=60)  # a single-rank sender's identity on 4 ranks
            try:
                wrong.send(eng, handles[:1], ["wrong"])
            except ConfigError as e:
                refused = str(e)
            finally:
                wrong.close()
        sender = KVSender(address, eng.world_rank, eng.world.size, timeout_s=60)
        sender.send(eng, handles, [f"pp-{mode}-{i}" for i in range(len(handles))])
        sender.close()
        exports = eng.export_kv_batch(handles, dst=0)
        out[mode] = [(e.k, e.v) for e in exports] if eng.world_rank == 0 else None
    return out, refused


def test_pipeline_stages_send_their_own_layers(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"pp-{m}-{i}" for m in MODES for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    ranks = launch(_send_pp, 4, folder, rx.address)
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    for _, refused in ranks:
        assert refused is not None and "give each sender its engine's world_rank and world.size" in refused
    for mode, exports in ranks[0][0].items():
        for i, (k, v) in enumerate(exports):
            recv = read_kv(tmp_path / f"pp-{mode}-{i}.safetensors")
            assert recv.meta.num_layers == 4 and recv.meta.dtype == PP_DTYPES[mode], (mode, i)
            assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), (mode, i)


#: (tp, cp, pp, cache mode, dtype): the KV heads split over attention TP 2 at CP 2; 2 KV
#: heads over attention TP 4 (each held by two ranks, written once); attention TP 2 in
#: each of two stages
ATTN_TP_RUNS = [(4, 2, 1, "replicated", "float32"), (4, 1, 1, "sharded", "bfloat16"),
                (2, 1, 2, "layer-split", "bfloat16")]


def _send_attn_tp(group, folder, address):
    """Every rank of the run sends its KV heads of the spans it owns; rank 0's export is
    what the receiver must hold."""
    from graphcp.pd.sender import KVSender

    out = []
    for tp, cp, pp, mode, dtype in ATTN_TP_RUNS:
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode, dtype=dtype), group,
                            parallel=ParallelConfig(tp_size=tp, cp_size=cp, pp_size=pp))
        handles = eng.prefill(_requests(eng.cfg.vocab_size)).handles
        sender = KVSender(address, eng.world_rank, eng.world.size, timeout_s=60)
        sender.send(eng, handles, [f"tp-{mode}-{i}" for i in range(len(handles))])
        sender.close()
        exports = eng.export_kv_batch(handles, dst=0)
        out.append([(e.k, e.v) for e in exports] if eng.world_rank == 0 else None)
    return out


def test_attention_tp_ranks_send_their_heads(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"tp-{r[3]}-{i}" for r in ATTN_TP_RUNS for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    sent = launch(_send_attn_tp, 4, folder, rx.address)[0]
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    for run, exports in zip(ATTN_TP_RUNS, sent):
        for i, (k, v) in enumerate(exports):
            recv = read_kv(tmp_path / f"tp-{run[3]}-{i}.safetensors")
            assert recv.meta.num_kv_heads == 2 and recv.meta.dtype == run[4], (run, i)
            assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), (run, i)


def _send_dp(group, folder, address):
    """Attention DP 2: each request is sent by the replica that holds it (the other
    replica's ranks write nothing); rank 0's export (the export under DP) is the truth."""
    from graphcp.pd.sender import KVSender

    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="sharded"), group,
                        parallel=ParallelConfig(tp_size=2, cp_size=1, dp_size=2))
    handles = eng.prefill(_requests(eng.cfg.vocab_size)).handles
    sender = KVSender(address, eng.world_rank, eng.world.size, timeout_s=60)
    sender.send(eng, handles, [f"dp-{i}" for i in range(len(handles))])
    sender.close()
    exports = eng.export_kv_batch(handles, dst=0)
    return [(e.k, e.v) for e in exports] if eng.world_rank == 0 else None, [h.replica for h in handles]


def test_attention_dp_replicas_send_their_own_requests(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"dp-{i}" for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    (sent, replicas), _ = launch(_send_dp, 2, folder, rx.address)
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    assert set(replicas) == {0, 1}  # both replicas hold (and send) a request
    for i, (k, v) in enumerate(sent):
        recv = read_kv(tmp_path / f"dp-{i}.safetensors")
        assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), i


def test_which_heads_an_attention_tp_rank_writes():
    """Its shard's heads; a head replicated over ranks by its first holder only; a format
    every rank holds whole (DeepSeek V4's one shared KV head) by attention-TP rank 0 only."""
    from types import SimpleNamespace as NS

    from graphcp.pd.sender import _heads_written

    def written(a, A, H, splits=True):
        parts = NS(mesh=NS(attn_tp=NS(rank=a, size=A)), family=NS(export_splits_heads=splits),
                   attn_cfg=NS(num_kv_heads=max(1, H // A)))
        return _heads_written(NS(parts=parts), NS(num_kv_heads=H))

    assert written(0, 1, 8) is None
    assert [written(a, 2, 8) for a in range(2)] == [(0, 4), (4, 4)]
    assert [written(a, 4, 2) for a in range(4)] == [(0, 1), (0, 0), (1, 1), (0, 0)]
    assert [written(a, 2, 1, splits=False) for a in range(2)] == [None, (0, 0)]


def _faulty_send(group, folder, address, ids, die_before_done=False):
    """One rank: prefill, then send request ``ids`` one by one (the same KV), catching
    each error with the time it took; then check the KV is all still there."""
    from graphcp.pd.sender import KVSender

    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=256), group)
    h = eng.prefill(_requests(eng.cfg.vocab_size)[2:3]).handles[0]
    before = eng.export_kv(h)
    outcomes = []
    for rid in ids:
        t0 = time.monotonic()
        try:
            sender = KVSender(address, timeout_s=TIMEOUT)
            if die_before_done:  # the sender process dies after writing its part, before "done"
                send = sender.channel.send
                sender.channel.send = lambda **m: os._exit(3) if m.get("op") == "done" else send(**m)
            sender.send(eng, [h], [rid])
            outcomes.append((rid, "ok", "", time.monotonic() - t0))
        except TransferError as e:
            outcomes.append((rid, type(e).__name__, str(e), time.monotonic() - t0))
    after = eng.export_kv(h)  # nothing lost: the same KV, still exportable
    same = all(torch.equal(a, b) for a, b in zip(before.k + before.v, after.k + after.v))
    return outcomes, same, (before.k, before.v)


def test_receiver_unreachable(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32")
    (outcomes, same, _), = launch(_faulty_send, 1, folder, f"127.0.0.1:{free_port()}", ["a"])
    (_, err, msg, took), = outcomes
    assert err == "ReceiverUnreachable" and "unreachable" in msg and took < TIMEOUT + 1, outcomes
    assert same


def test_failed_write_then_retry(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32")
    rx = Receiver("bad-address", tmp_path, ["a", "b"])
    (outcomes, same, (k, v)), = launch(_faulty_send, 1, folder, rx.address, ["a", "b"])
    got = rx.results()
    (_, err, msg, took), retry = outcomes
    assert err == "TransferFailed" and "Mooncake write" in msg and took < TIMEOUT + 1, outcomes
    assert retry[1] == "ok" and same
    assert got["a"][0] == "TransferFailed" and "aborted" in got["a"][1]  # never handed out
    recv = read_kv(tmp_path / "b.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v))


def test_acknowledgement_times_out(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32")
    rx = Receiver("never-acks", tmp_path, ["a"], timeout_s=TIMEOUT / 2)  # it gives up first, silently
    (outcomes, same, _), = launch(_faulty_send, 1, folder, rx.address, ["a"])
    got = rx.results()
    (_, err, msg, took), = outcomes
    assert err == "TransferTimeout" and "acknowledgement" in msg and TIMEOUT - 0.5 < took < TIMEOUT + 2, outcomes
    assert same
    assert got["a"][0] == "TransferTimeout" and got["completed"] == []


def test_receiver_dies_mid_request(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32")
    rx = Receiver("dies", tmp_path, ["a"])
    (outcomes, same, _), = launch(_faulty_send, 1, folder, rx.address, ["a"])
    rx.proc.join(timeout=10)
    (_, err, msg, took), = outcomes
    assert err == "ReceiverDied" and took < TIMEOUT + 1, outcomes
    assert rx.proc.exitcode == 3 and same


def test_sender_dies_mid_request(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32")
    rx = Receiver("good", tmp_path, ["a"])
    with pytest.raises(Exception, match="rank 0 died"):
        launch(_faulty_send, 1, folder, rx.address, ["a"], True)
    t0 = time.monotonic()
    got = rx.results()
    assert got["a"][0] == "SenderDied" and "closed before it finished" in got["a"][1], got
    assert got["completed"] == [] and not (tmp_path / "a.safetensors").exists()  # nothing partial handed out
    assert time.monotonic() - t0 < TIMEOUT + 5
