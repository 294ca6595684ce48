"""PD between any two shapes (issue 49, docs/pd.md "Import"): a request prefilled by one
graphcp engine (one CP size, cache mode, attention TP, pipeline split or attention DP),
exported to a file, and imported by another of another shape with ``engine.import_kv``, continues
exactly: its greedy ids over 16 tokens equal transformers' ``generate``, every step's
logits within 1e-4 (float32; bfloat16 within the suite's 2e-2 of transformers in bfloat16 on
the same sequence), for a dense and a MoE model. Every pair runs through files and through
Mooncake on loopback (a receiver process holds each request in its shared arena, its token
ids and first-token logits with it, equal to the file's bit for bit; the decode ranks import
from it in place and decode from its logits; the arena whole again after the release). A second turn after the import
(``prefill(prefix=imported handle)``) matches transformers on the whole sequence;
``generate`` continues from the imported handle; the receiver's pool after release equals
the pool before. Each request is prefilled in two chunks at the source (a cached prefix,
then the rest), so the source's own layout of it (zigzag blocks of two chunks, decoded
tokens none) differs from the one the import derives (one chunk at the target's CP).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_greedy, rel_err

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.pd.files import KVFile, save_kv
from graphcp.pd.mooncake import mooncake_problem
from graphcp.pd.receiver import RegionRef

PAGE = 16
LENS = ((20, 25), (0, 13))  # (cached prefix, rest): request 0 in two chunks
NEW = 16  # greedy tokens: the prefill's (the export's last_logits), then 15 decode steps
TURN = 9  # a second turn's new prompt tokens
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
#: why the Mooncake transport cannot run here (None: it can; every pair then runs through it too)
MOONCAKE = mooncake_problem()
MODELS = {"dense": ("qwen3", {}), "moe": ("qwen3_moe", {})}


def shape(cp=1, kv="replicated", attn_tp=1, pp=1, dp=1) -> dict:
    return {"cp": cp, "kv": kv, "attn_tp": attn_tp, "pp": pp, "dp": dp}


def ranks(s: dict) -> int:
    return s["cp"] * s["attn_tp"] * s["pp"] * s["dp"]


def _engine(folder, group, s: dict, dtype: str = "float32", graph: str = "off") -> PrefillEngine:
    par = ParallelConfig(cp_size=s["cp"], pp_size=s["pp"], dp_size=s["dp"], tp_size=s["cp"] * s["dp"] * s["attn_tp"])
    rt = RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=s["kv"], page_size=PAGE, graph=graph)
    return PrefillEngine(folder, rt, group, parallel=par)


def _prompts(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, p + n) for p, n in LENS]


def _turn(vocab: int) -> np.ndarray:
    return np.random.default_rng(9).integers(0, vocab, TURN)


def _source_job(group, folders: dict, s: dict, dtype: str, out: Path, mooncake: str | None = None):
    """Prefill both prompts (request 0 after a cached prefix of its first tokens) at shape
    ``s`` and export each with its tokens and first-token logits to a file in ``out`` (the
    file transport): model -> the files, on the run's rank 0 (None elsewhere). With
    ``mooncake`` (a receiver's address) every rank also sends its part there first (ids
    ``<model>-<i>``)."""
    files = {}
    for model, folder in folders.items():
        eng = _engine(folder, group, s, dtype)
        prompts = _prompts(eng.cfg.vocab_size)
        first = eng.prefill([Request(prompts[0][:LENS[0][0]])]).handles[0]
        res = eng.prefill([Request(prompts[0][LENS[0][0]:], prefix=first), Request(prompts[1])])
        if mooncake is not None:
            from graphcp.pd.sender import KVSender

            sender = KVSender(mooncake, eng.world_rank, eng.world.size, timeout_s=60)
            sender.send(eng, res.handles, [f"{model}-{i}" for i in range(len(res.handles))], prompts,
                        res.last_logits)  # the ids and first-token logits ride in the region
            sender.close()
        dst = None if s["cp"] == 4 else 0  # to every rank, or to rank 0 alone
        exports = eng.export_kv_batch(res.handles, dst=dst)
        if eng.world_rank == 0:
            files[model] = []
            for i, (e, p, logits) in enumerate(zip(exports, prompts, res.last_logits)):
                e.token_ids, e.last_logits = torch.from_numpy(p), logits.clone()
                files[model].append(save_kv(e, out / f"{model}-{dtype}-{i}.safetensors"))
        for h in res.handles:
            eng.release(h)
    return files if group.rank == 0 else None


def _payload(x):
    """A request held in a Mooncake receiver's shared arena (a RegionRef: views of the bytes
    Mooncake wrote, its token ids and first-token logits with them), or a file's path
    (import_kv reads its share)."""
    return x.open() if isinstance(x, RegionRef) else x


def _last_logits(x) -> torch.Tensor:
    return x.open().last_logits if isinstance(x, RegionRef) else KVFile(x).last_logits


def _continue(eng, payloads: list, generate: bool) -> dict:
    """Import ``payloads`` (files: every rank reads its share by path; RegionRefs: every rank
    maps the receiver's region); decode NEW - 1 steps from their first tokens (no recompute: the
    export's last_logits give it), release; import request 0 again and prefill a second
    turn after it; with ``generate`` also ``generate`` from an imported handle. The pool's
    state before and after each."""
    s = eng.parallel
    kv = eng.parts.kv
    before = kv.snapshot()
    lasts = torch.stack([_last_logits(f) for f in payloads])
    handles = [eng.import_kv(_payload(f)) for f in payloads]
    tok = lasts.argmax(-1)
    toks, logits = [tok], [lasts]
    can_decode = s.pp_size == 1 and s.dp_size == 1
    for _ in range(NEW - 1 if can_decode else 0):
        step = eng.decode(handles, tok, logits=True)
        handles, tok = step.handles, step.logits.argmax(-1)
        toks.append(tok)
        logits.append(step.logits)
    for h in handles:
        eng.release(h)
    after_decode = kv.snapshot()
    h = eng.import_kv(_payload(payloads[0]))
    first = int(lasts[0].argmax())
    turn = np.concatenate([[first], _turn(eng.cfg.vocab_size)])
    second = eng.prefill([Request(turn, prefix=h)], all_logits=True)
    eng.release(second.handles[0])
    gen = None
    if generate and can_decode:
        h = eng.import_kv(_payload(payloads[0]))
        gen = eng.generate([Request([first], prefix=h)], NEW - 1).tokens[0][0]
    return {"tokens": torch.stack(toks, 1), "logits": torch.stack(logits, 1), "second": second.logits[0],
            "generate": gen, "before": before, "after_decode": after_decode, "after": kv.snapshot()}


def _target_job(group, folders: dict, s: dict, dtype: str, by_transport: dict):
    """Each model's engine at shape ``s`` continues each transport's payloads in turn
    (:func:`_continue`; ``generate`` for the first model's files): results by ``<model>``
    (files) and ``<model>/<transport>``."""
    out = {}
    for model, folder in folders.items():
        eng = _engine(folder, group, s, dtype)
        for transport, payloads in by_transport.items():
            key = model if transport == "file" else f"{model}/{transport}"
            out[key] = _continue(eng, payloads[model], model == next(iter(folders)) and transport == "file")
    return out


ARENA = 64 << 20


def _holding_receiver(ready, refs, release, done, ids, timeout_s):
    """A decode side's receiver (a process of its own: Mooncake's threads are not forked
    into the ranks): a shared arena, each request held in place until ``release``; then
    whether the arena is whole again and its file gone after close."""
    torch.set_num_threads(1)
    from graphcp.pd.errors import TransferError
    from graphcp.pd.receiver import KVReceiver

    rx = KVReceiver(ARENA, timeout_s=timeout_s, shared=True)
    ready.put(rx.address)
    held = []
    try:
        held = [rx.hold(rid, timeout_s=timeout_s) for rid in ids]
        refs.put(pickle.dumps([h.ref for h in held]))
    except TransferError as e:
        refs.put(pickle.dumps(f"{type(e).__name__}: {e}"))
    release.wait(600)
    for h in held:
        h.release()
    whole = rx.free_bytes == ARENA
    rx.close()
    done.put((whole, os.path.exists(rx.path)))


def run_pair(folders: dict, src: dict, dst: dict, via: Path, dtype: str = "float32",
             mooncake: bool = MOONCAKE is None) -> list[dict]:
    """Every target rank's results of importing what ``src`` exported, through files in
    ``via`` (``<model>``) and, with ``mooncake``, through a Mooncake receiver on loopback
    whose shared arena the target ranks import from in place (``<model>/mooncake``); the
    receiver's arena is whole again after the release."""
    ids = [f"{m}-{i}" for m in folders for i in range(len(LENS))]
    rx = None
    if mooncake:
        ctx = mp.get_context("fork")
        queues, release = [ctx.Queue() for _ in range(3)], ctx.Event()
        rx = ctx.Process(target=_holding_receiver, args=(*queues[:2], release, queues[2], ids, 120))
        rx.start()
    try:
        address = None if rx is None else queues[0].get(timeout=120)
        files = (launch(_source_job, ranks(src), folders, src, dtype, via, address)[0] if ranks(src) > 1
                 else _source_job(CPGroup(), folders, src, dtype, via, address))
        by_transport = {"file": files}
        if rx is not None:
            refs = pickle.loads(queues[1].get(timeout=180))
            assert not isinstance(refs, str), refs
            by_ref = dict(zip(ids, refs))
            by_transport["mooncake"] = {m: [by_ref[f"{m}-{i}"] for i in range(len(fs))] for m, fs in files.items()}
            for m, fs in files.items():  # the ids and logits arrived with the KV, the file's bit for bit
                for ref, f in zip(by_transport["mooncake"][m], fs):
                    got, want = ref.open(), KVFile(f)
                    assert torch.equal(got.token_ids, want.token_ids), (m, f)
                    assert torch.equal(got.last_logits, want.last_logits), (m, f)
        if ranks(dst) == 1:
            results = [_target_job(CPGroup(), folders, dst, dtype, by_transport)]
        else:
            results = launch(_target_job, ranks(dst), folders, dst, dtype, by_transport)
    finally:
        if rx is not None:
            release.set()
    if rx is not None:
        assert queues[2].get(timeout=60) == (True, False)  # the arena whole again, its file removed
        rx.join(timeout=30)
    return results


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: {m: hf_model_dir(f, False, dtype, **kw) for m, (f, kw) in MODELS.items()}
            for dtype in ("float32", "bfloat16")}


def hf_reference(hf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' greedy ids [R, NEW] of both prompts, their logits [R, NEW, V], and the
    second turn's logits over the whole sequence of request 0 (float32)."""
    prompts = _prompts(hf.config.vocab_size)
    toks, logits = hf_greedy(hf, prompts, NEW)
    seq = np.concatenate([prompts[0], [int(toks[0][0])], _turn(hf.config.vocab_size)])
    with torch.inference_mode():
        whole = hf(input_ids=torch.from_numpy(seq).view(1, -1)).logits[0, len(prompts[0]):].float()
    return toks, logits, whole


def check_bf16(got: dict, hf) -> None:
    """Every step's logits within 2e-2 of transformers in bfloat16 on the same sequence."""
    for j, p in enumerate(_prompts(hf.config.vocab_size)):
        seq = torch.cat([torch.from_numpy(p), got["tokens"][j, :-1]]).view(1, -1)
        with torch.inference_mode():
            ref = hf(input_ids=seq).logits[0, len(p) - 1:].float()
        assert rel_err(got["logits"][j], ref) <= TOL["bfloat16"], j


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """model -> :func:`hf_reference` of its float32 checkpoint."""
    return {m: hf_reference(hf_model(folder, "float32")) for m, folder in folders["float32"].items()}


def pool(snapshot: tuple) -> tuple:
    """A cache's snapshot as the pool's state: the free pages as a set (releasing two
    requests that decoded in turn gives their pages back in another order), the live
    sequences, and the sharded ledger when there is one."""
    return (tuple(sorted(snapshot[0])),) + snapshot[1:]


def check_pair(results: list[dict], reference: dict, decodes: bool = True) -> None:
    """Each rank's results of each model (and each model through Mooncake, where it runs)."""
    for rank, per_model in enumerate(results):
        models = {m.split("/")[0] for m in per_model}
        assert MOONCAKE is not None or all(f"{m}/mooncake" in per_model for m in models), sorted(per_model)
        for m, got in per_model.items():
            ref_toks, ref_logits, whole = reference[m.split("/")[0]]
            where = (m, rank)
            if decodes:
                assert torch.equal(got["tokens"], ref_toks), (where, got["tokens"], ref_toks)
                for i in range(NEW):
                    assert rel_err(got["logits"][:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
                assert pool(got["after_decode"]) == pool(got["before"]), where  # the pool after release
            assert rel_err(got["second"], whole) <= TOL["float32"], where
            if got["generate"] is not None:
                assert got["generate"] == ref_toks[0, 1:].tolist(), where
            assert pool(got["after"]) == pool(got["before"]), where


# ---- the acceptance pairs: 4 ranks on one side ------------------------------------------

PAIRS = {
    "cp4-sharded->cp2-sharded": (shape(4, "sharded"), shape(2, "sharded")),
    "cp2-layer-split->cp4-sharded": (shape(2, "layer-split"), shape(4, "sharded")),
    "cp2xtp2->cp1": (shape(2, "replicated", attn_tp=2), shape(1)),
    "pp2xcp2->cp2-replicated": (shape(2, "replicated", pp=2), shape(2, "replicated")),
    "cp1->cp4-sharded": (shape(1), shape(4, "sharded")),
    "dp2xcp2->cp2-sharded": (shape(2, "sharded", dp=2), shape(2, "sharded")),
}


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_prefill_at_one_shape_decodes_at_another(folders, reference, pair, tmp_path):
    src, dst = PAIRS[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.slow
def test_bfloat16_import_decodes_within_the_suites_bound(folders, hf_model, tmp_path):
    """The first pair in bfloat16: every step's logits within 2e-2 of transformers in
    bfloat16 on the same sequence (the dense model)."""
    dense = {"dense": folders["bfloat16"]["dense"]}
    src, dst = PAIRS["cp4-sharded->cp2-sharded"]
    got = run_pair(dense, src, dst, tmp_path, "bfloat16", mooncake=False)[0]["dense"]
    check_bf16(got, hf_model(folders["bfloat16"]["dense"], "bfloat16"))


# ---- 2 ranks: across CP sizes and modes, into attention TP and pipeline stages -------------

FAST = {
    "cp2-sharded->cp1": (shape(2, "sharded"), shape(1)),
    "cp1->cp2-sharded": (shape(1), shape(2, "sharded")),
    "cp2-layer-split->cp2-sharded": (shape(2, "layer-split"), shape(2, "sharded")),
    "cp1->attn-tp2": (shape(1), shape(1, attn_tp=2)),
}


@pytest.mark.parametrize("pair", list(FAST))
def test_import_across_cp_sizes_and_modes(folders, reference, pair, tmp_path):
    src, dst = FAST[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.parametrize("dst", [shape(1, pp=2), shape(1, "sharded", dp=2)], ids=["pp2", "dp2"])
def test_import_into_stages_or_replicas_extends_exactly(folders, reference, tmp_path, dst):
    """Pipeline stages: each stage places its own layers; attention DP: the replica with the
    most free pages takes the request (a ReplicaHandle). A next turn's prefill after the
    imported handle matches transformers (decode under stages and DP is refused: the second
    turn is the check)."""
    check_pair(run_pair(folders["float32"], shape(1, "layer-split"), dst, tmp_path), reference, decodes=False)


@pytest.mark.slow
def test_import_into_attention_tp_4_with_replicated_kv_heads(folders, reference, tmp_path):
    """2 KV heads over attention TP 4: each head placed on the two ranks that read it."""
    check_pair(run_pair(folders["float32"], shape(2, "sharded"), shape(1, attn_tp=4), tmp_path), reference)


# ---- the other families' formats: placed at another shape --------------------------------

def _flat(export) -> list[torch.Tensor]:
    return [export.tensor(i, n) for i, n in export.meta.tensors()]


def _family_job(group, folder, src: dict, dst: dict):
    """Prefill at ``src`` (request 0 after a cached prefix), export, import at ``dst`` in
    the same ranks; the payload, the import's re-export, and a second turn's logits after
    the source's handle and after the imported one."""
    a, b = _engine(folder, group, src), _engine(folder, group, dst)
    prompts = _prompts(a.cfg.vocab_size)
    first = a.prefill([Request(prompts[0][:LENS[0][0]])]).handles[0]
    res = a.prefill([Request(prompts[0][LENS[0][0]:], prefix=first)])
    payload = a.export_kv(res.handles[0])
    turn = np.concatenate([[int(res.last_logits[0].argmax())], _turn(a.cfg.vocab_size)])
    ref = a.prefill([Request(turn, prefix=res.handles[0])], all_logits=True).logits[0]
    before = b.parts.kv.snapshot()
    h = b.import_kv(payload)
    again = b.export_kv(h)
    second = b.prefill([Request(turn, prefix=h)], all_logits=True)
    b.release(second.handles[0])
    return _flat(payload), _flat(again), ref, second.logits[0], pool(before) == pool(b.parts.kv.snapshot())


@pytest.mark.parametrize("family,src,dst", [
    ("qwen3_5_moe_text", shape(2, "sharded"), shape(1, attn_tp=2)),  # K/V and linear states, heads split
    ("qwen3_5_text", shape(2, "layer-split"), shape(2, "sharded")),
    ("deepseek_v32", shape(2, "layer-split"), shape(2, "replicated")),  # MLA latents (no sharded cache)
])
def test_other_formats_are_placed_at_another_shape(hf_model_dir, family, src, dst):
    """A hybrid's and a DSA model's payload placed by another shape's storage: its
    re-export is the payload bit for bit, and a next turn after it equals the source
    engine's own next turn (these families' decode steps are checked where they are built)."""
    folder = hf_model_dir(family, False, "float32")
    for payload, again, ref, got, same_pool in launch(_family_job, 2, folder, src, dst):
        assert all(torch.equal(x, y) for x, y in zip(again, payload, strict=True))
        assert rel_err(got, ref) <= TOL["float32"]
        assert same_pool
