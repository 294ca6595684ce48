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
from graphcp.pd.riders import as_ids

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


#: the cache modes whose sends carry the token ids and first-token logits (the others: none)
RIDERS = ("replicated", "sharded")


def _send_batch(group, folder, address):
    from graphcp.pd.sender import KVSender

    out = {}
    for mode in MODES:
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode), group)
        reqs = _requests(eng.cfg.vocab_size)
        res = eng.prefill(reqs)
        ids = [torch.from_numpy(np.asarray(r.tokens)) for r in reqs]
        if mode == "sharded":  # a second chunk: each rank's positions in several runs
            res = eng.prefill([Request([7, 8, 9, 10, 11], h) for h in res.handles])
            ids = [torch.cat([t, torch.tensor([7, 8, 9, 10, 11])]) for t in ids]
        handles, riders = res.handles, (ids, res.last_logits) if mode in RIDERS else (None, None)
        sender = KVSender(address, group.rank, group.size, timeout_s=60)
        sender.send(eng, handles, [f"{mode}-{i}" for i in range(len(handles))], *riders)
        sender.close()
        exports = eng.export_kv_batch(handles, dst=0)  # every rank takes part; rank 0 gets them
        out[mode] = [(e.k, e.v, *as_sent(riders, i)) for i, e in enumerate(exports)] if group.rank == 0 else None
    return out


def as_sent(riders: tuple, i: int) -> tuple:
    """Request ``i``'s token ids and logits as sent (None, None: none were)."""
    ids, logits = riders
    return (None, None) if ids is None else (as_ids(ids[i]), logits[i].float().clone())


def same_riders(recv, ids, logits) -> bool:
    """The received token ids and first-token logits are the sent ones bit for bit (both
    absent when none were sent)."""
    if ids is None:
        return recv.token_ids is None and recv.last_logits is None
    return (recv.token_ids.dtype == torch.int64 and recv.last_logits.dtype == torch.float32
            and torch.equal(recv.token_ids, ids) and torch.equal(recv.last_logits, logits))


def test_two_ranks_send_a_mixed_batch_bitwise(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"{m}-{i}" for m in MODES for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    sent = launch(_send_batch, 2, folder, rx.address)[0]
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    for mode, exports in sent.items():
        for i, (k, v, ids, logits) in enumerate(exports):
            recv = read_kv(tmp_path / f"{mode}-{i}.safetensors")  # what rx.get gave, written as a file
            assert recv.meta.num_tokens == LENS[i] + 5 * (mode == "sharded") and recv.meta.num_layers == 4
            assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), (mode, i)
            assert (ids is not None) == (mode in RIDERS) and same_riders(recv, ids, logits), (mode, i)


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
        reqs = _requests(eng.cfg.vocab_size)
        res = eng.prefill(reqs)
        handles, riders = res.handles, ([r.tokens for r in reqs], res.last_logits)
        if mode == "replicated":
            wrong = KVSender(address, 0, 1, timeout_s=60)  # a single-rank sender's identity on 4 ranks
            try:
                wrong.send(eng, handles[:1], ["wrong"])
            except ConfigError as e:
                refused = str(e)
            finally:
                wrong.close()
        sender = KVSender(address, eng.world_rank, eng.world.size, timeout_s=60)
        sender.send(eng, handles, [f"pp-{mode}-{i}" for i in range(len(handles))], *riders)
        sender.close()
        exports = eng.export_kv_batch(handles, dst=0)
        out[mode] = [(e.k, e.v, *as_sent(riders, i)) for i, e in enumerate(exports)] if eng.world_rank == 0 else None
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
        for i, (k, v, ids, logits) in enumerate(exports):
            recv = read_kv(tmp_path / f"pp-{mode}-{i}.safetensors")
            assert recv.meta.num_layers == 4 and recv.meta.dtype == PP_DTYPES[mode], (mode, i)
            assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), (mode, i)
            assert same_riders(recv, ids, logits), (mode, i)  # (a bfloat16 model's float32 logits)


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
    reqs = _requests(eng.cfg.vocab_size)
    res = eng.prefill(reqs)
    handles, riders = res.handles, ([r.tokens for r in reqs], res.last_logits)
    sender = KVSender(address, eng.world_rank, eng.world.size, timeout_s=60)
    sender.send(eng, handles, [f"dp-{i}" for i in range(len(handles))], *riders)  # (rank 0 writes them for both)
    sender.close()
    exports = eng.export_kv_batch(handles, dst=0)
    return ([(e.k, e.v, *as_sent(riders, i)) for i, e in enumerate(exports)] if eng.world_rank == 0 else None,
            [h.replica for h in handles])


def test_attention_dp_replicas_send_their_own_requests(hf_model_dir, tmp_path):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ids = [f"dp-{i}" for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    (sent, replicas), _ = launch(_send_dp, 2, folder, rx.address)
    got = rx.results()
    assert sorted(got.pop("completed")) == [] and all(v == ("ok", "") for v in got.values()), got
    assert set(replicas) == {0, 1}  # both replicas hold (and send) a request
    for i, (k, v, ids, logits) in enumerate(sent):
        recv = read_kv(tmp_path / f"dp-{i}.safetensors")
        assert all(torch.equal(a, b) for a, b in zip(recv.k + recv.v, k + v)), i
        assert same_riders(recv, ids, logits), i


def test_which_rows_an_attention_tp_rank_writes():
    """Its shard's heads (each to the whole tensor's row of that head); a head replicated
    over ranks by its first holder only; a format every rank holds whole (DeepSeek V4's one
    shared KV head) by attention-TP rank 0 only. (A hybrid's conv channels and recurrent
    heads: test_pd_import_hybrid.py's CP 2 x attention TP 2 pair through Mooncake.)"""
    from types import SimpleNamespace as NS

    from graphcp.pd.export import take_kv_heads
    from graphcp.pd.sender import _shard, shard_runs

    def rows(H, A, a):
        meta = NS(take_heads=lambda layer, name, whole, size, rank: take_kv_heads(whole, H, size, rank),
                  tensor_shape=lambda layer, name: (H, 5, 4))
        runs = [(o * 10, 100 + o * 10, 10) for o in range(H)]  # a span's run of each head
        return [(s, d) for s, d, _ in shard_runs(meta, 0, "k", runs, A, a)]

    assert [rows(8, 2, a) for a in range(2)] == [[(0, 100), (10, 110), (20, 120), (30, 130)],
                                                 [(0, 140), (10, 150), (20, 160), (30, 170)]]
    assert [rows(2, 4, a) for a in range(4)] == [[(0, 100)], [], [(0, 110)], []]

    def shard(a, A, splits=True):
        return _shard(NS(parts=NS(mesh=NS(attn_tp=NS(rank=a, size=A)), family=NS(export_splits_heads=splits))))

    assert shard(0, 1) is None and [shard(a, 2) for a in range(2)] == [(2, 0), (2, 1)]
    assert [shard(a, 2, splits=False) for a in range(2)] == [None, (0, 0)]


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


def _holding_main(ready, out, rid):
    torch.set_num_threads(1)
    from graphcp.pd.receiver import KVReceiver

    rx = KVReceiver(8 << 20, timeout_s=60, shared=True)
    ready.put(rx.address)
    with rx.hold(rid) as held:
        k = held.export.k[0]
        base, size = rx.buffer.data_ptr(), rx.buffer.numel()
        in_place = all(base <= t.data_ptr() < base + size for t in held.export.k + held.export.v)
        opened = held.ref.open()  # as a decode rank maps it
        same = all(torch.equal(a, b) for a, b in zip(opened.k + opened.v, held.export.k + held.export.v))
        riders = [held.export.token_ids, held.export.last_logits]
        in_place = in_place and all(base <= t.data_ptr() < base + size for t in riders)
        same = same and all(torch.equal(a, b) for a, b in zip([opened.token_ids, opened.last_logits], riders))
        riders = [t.clone() for t in riders]
        k.add_(1)  # a write to the arena is seen through the other mapping: no copy between them
        shared = torch.equal(opened.k[0], k)
        free_held = rx.free_bytes
        values = [(a.clone(), b.clone()) for a, b in zip(opened.k, opened.v)]
    out.put(pickle.dumps({"in_place": in_place, "same": same, "shared": shared, "held": free_held < 8 << 20,
                          "released": rx.free_bytes == 8 << 20, "values": values, "riders": riders}))
    rx.close()
    out.put(os.path.exists(rx.path))


def _send_one(group, folder, address):
    from graphcp.pd.sender import KVSender

    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="sharded"), group)
    req = _requests(eng.cfg.vocab_size)[2]
    res = eng.prefill([req])
    h = res.handles[0]
    sender = KVSender(address, group.rank, group.size, timeout_s=60)
    sender.send(eng, [h], ["held-0"], [req.tokens], res.last_logits)
    sender.close()
    e = eng.export_kv(h, dst=0)
    return None if e is None else (list(zip(e.k, e.v)), as_sent(([req.tokens], res.last_logits), 0))


def test_a_held_request_is_lent_in_place_from_a_shared_arena(hf_model_dir):
    """KVReceiver.hold: the request as views of the registered arena (no copy out), which
    another process maps (RegionRef.open) and sees the same bytes; the region back on
    release, the arena's file removed on close; the KV equal to the export."""
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    ctx = mp.get_context("fork")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_holding_main, args=(ready, out, "held-0"))
    proc.start()
    try:
        sent, riders = launch(_send_one, 2, folder, ready.get(timeout=120))[0]
        got = pickle.loads(out.get(timeout=120))
        assert all(torch.equal(a, b) for a, b in zip(got["riders"], riders, strict=True))  # ids, logits
        assert got["in_place"] and got["same"] and got["shared"] and got["held"] and got["released"], got
        assert out.get(timeout=60) is False  # the file removed
        (k0, v0), *rest = got["values"]
        assert torch.equal(k0, sent[0][0] + 1) and torch.equal(v0, sent[0][1])  # (the write seen above)
        assert all(torch.equal(a, x) and torch.equal(b, y) for (a, b), (x, y) in zip(rest, sent[1:]))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


STEPS = 8


def _getting_main(ready, out, rid):
    """A decode side's receiver: the request as ``rx.get`` hands it out (a copy), pickled."""
    torch.set_num_threads(1)
    from graphcp.pd.receiver import KVReceiver

    rx = KVReceiver(8 << 20, timeout_s=60)
    ready.put(rx.address)
    out.put(pickle.dumps(rx.get(rid)))
    out.put(rx.free_bytes == 8 << 20)
    rx.close()


def _send_and_save(group, folder, address, dtype, path):
    """CP 2 sharded: prefill a request after a cached prefix, send it with its ids and
    logits, and (rank 0) write the same request to a file (the file transport's payload)."""
    from graphcp.pd.sender import KVSender

    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="sharded", dtype=dtype), group)
    prompt = np.asarray(_requests(eng.cfg.vocab_size)[2].tokens)
    first = eng.prefill([Request(prompt[:30])]).handles[0]
    res = eng.prefill([Request(prompt[30:], first)])
    sender = KVSender(address, group.rank, group.size, timeout_s=60)
    sender.send(eng, res.handles, ["first-step"], [prompt], res.last_logits)
    sender.close()
    e = eng.export_kv(res.handles[0], dst=0)
    if e is not None:
        e.token_ids, e.last_logits = torch.from_numpy(prompt), res.last_logits[0]
        save_kv(e, path)
    return prompt


def _decode_without_prefill(engine, payload, first: int) -> tuple[list[int], torch.Tensor]:
    """Import and greedy-decode STEPS - 1 steps after ``first``; the engine's prefill
    forbidden (nothing of the prompt is recomputed). Ids and each step's logits."""
    def no_prefill(*a, **k):
        raise AssertionError("the decode side recomputed the prompt")

    engine.prefill = no_prefill
    h = engine.import_kv(payload)
    toks, logits = [first], []
    for _ in range(STEPS - 1):
        step = engine.decode([h], [toks[-1]], logits=True)
        h = step.handles[0]
        toks.append(int(step.logits[0].argmax()))
        logits.append(step.logits[0])
    engine.release(h)
    del engine.prefill
    return toks, torch.stack(logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_received_request_decodes_from_its_own_logits(hf_model_dir, hf_model, tmp_path, dtype):
    """The token ids and first-token logits travel in the request's region: ``rx.get``'s
    export carries the sender's bit for bit, and a decode engine of another shape (CP 1)
    imports it and continues from its ``last_logits.argmax()`` with no recompute: the
    same ids and logits as from the file (float32 and bfloat16), transformers' ids in float32."""
    from graphcp.pd.files import KVFile

    folder = hf_model_dir("qwen3", False, dtype, num_hidden_layers=4)
    ctx = mp.get_context("fork")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_getting_main, args=(ready, out, "first-step"))
    proc.start()
    try:
        path = tmp_path / "first-step.safetensors"
        prompt = launch(_send_and_save, 2, folder, ready.get(timeout=120), dtype, path)[0]
        got = pickle.loads(out.get(timeout=120))
        assert out.get(timeout=60)  # its region back
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    file = KVFile(path)
    assert torch.equal(got.token_ids, file.token_ids) and torch.equal(got.token_ids, torch.from_numpy(prompt))
    assert got.last_logits.dtype == torch.float32 and torch.equal(got.last_logits, file.last_logits)
    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="replicated", dtype=dtype))
    first = int(got.last_logits.argmax())
    toks, logits = _decode_without_prefill(engine, got, first)
    want_toks, want_logits = _decode_without_prefill(engine, file, int(file.last_logits.argmax()))
    assert toks == want_toks and torch.equal(logits, want_logits)
    if dtype == "float32":
        from helpers import hf_greedy

        ref, _ = hf_greedy(hf_model(folder, dtype), [prompt], STEPS)
        assert toks == ref[0].tolist(), (toks, ref[0].tolist())
