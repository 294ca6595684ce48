"""``graphcp pd-demo``: one prefill/decode round trip on this machine, graphcp on both sides.

A receiver process (the decode side's) starts a :class:`KVReceiver`; graphcp prefills a
prompt at one shape (``--cp 4 --kv-cache sharded`` by default: a cached prefix first,
then the rest extending it), and every rank sends its part of the request's KV straight
into the receiver's memory through the Mooncake transfer engine on loopback TCP, the
prompt's ids and first-token logits with it (``--transport file``: one safetensors file
instead, holding the same). A graphcp decode engine of another
shape (``--decode-cp 2 --decode-kv-cache sharded``) imports the received request
(``engine.import_kv``: each rank places its share, read in place from the receiver's
shared arena, or from the file) and decodes it greedily from the
first token the received logits give (nothing recomputed, no side channel). The demo
prints the TTFT, the transfer's bytes and time, the decode tokens per second, and whether
the tokens match transformers run alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphcp.cli.generate import check_decode
from graphcp.cli.imported import check_import
from graphcp.cli.table import print_table
from graphcp.combinations import check as check_combination
from graphcp.combinations import flags_named, parallel_settings, refusal
from graphcp.dist import die_with_parent, ignore_sigint, sigint_deferred
from graphcp.errors import ConfigError
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec, preflight
from graphcp.jobs.spec import JobSpec, make_engine, run_job_on_ranks
from graphcp.model.presets import resolve_model
from graphcp.pd.errors import TransferError
from graphcp.pd.files import KVFile, read_kv, save_kv
from graphcp.pd.hf import greedy_continue
from graphcp.pd.load import to_transformers_cache
from graphcp.pd.mooncake import PD_EXTRA, mooncake_problem
from graphcp.pd.receiver import KVReceiver, RegionRef, shared_path
from graphcp.pd.sender import KVSender
from graphcp.runtime.engine import prefill_after_prefixes

REQUEST_ID = "demo-0"


def _prompt(vocab: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, n)


def _prefill_and_send(group, spec: JobSpec, prompt: np.ndarray, prefix: int, transport: str, where: str,
                      timeout_s: float) -> dict | None:
    """Every rank: prefill the prompt (prefix first), then hand its KV to the decode side."""
    engine = make_engine(group, spec)
    batch = [(prompt[:prefix] if prefix else None, prompt[prefix:])]
    for h in prefill_after_prefixes(engine, batch).handles:  # warm: the graphs this prompt takes, captured
        engine.release(h)
    t0 = time.perf_counter()
    out = prefill_after_prefixes(engine, batch)
    ttft = time.perf_counter() - t0
    handle = out.handles[0]
    t0 = time.perf_counter()
    if transport == "mooncake":  # the prompt's ids and first-token logits ride in the request's region
        sender = KVSender(where, engine.world_rank, engine.world.size, timeout_s=timeout_s)
        sender.send(engine, [handle], [REQUEST_ID], [prompt], out.last_logits[:1])
        sender.close()
    else:
        export = engine.export_kv(handle, dst=0)
        if export is not None:
            export.token_ids, export.last_logits = torch.from_numpy(prompt), out.last_logits[0]
            save_kv(export, Path(where) / f"{REQUEST_ID}.safetensors")
    took = time.perf_counter() - t0
    meta = engine.kv_meta(handle)
    engine.release(handle)  # acknowledged (or written): the prefill side lets it go
    if engine.world_rank != 0:
        return None
    return {"bytes": meta.nbytes, "transfer_s": took, "ttft_s": ttft, "path": out.info.path}


def _receive_main(transport: str, shm: str, ready, jobs, results, timeout_s: float, parent_pid: int) -> None:
    """The decode side's receiver: the request's KV from Mooncake, held in place in a shared
    arena (file ``shm``) that every decode rank maps and imports from, or the file's path
    (each rank reads its share); released once the decode side says so."""
    die_with_parent(parent_pid)  # as the ranks: a killed pd-demo takes it with it
    ignore_sigint()  # Ctrl-C is the command's to handle: it kills this process
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    receiver = held = folder = None
    try:
        if transport == "mooncake":
            receiver = KVReceiver(256 << 20, timeout_s=timeout_s, shared=shm)
        else:
            folder = tempfile.mkdtemp(prefix="graphcp-pd-")
        ready.put(receiver.address if receiver is not None else folder)
        if jobs.get() is None:
            return
        if receiver is not None:
            held = receiver.hold(REQUEST_ID)
            payload = held.ref
        else:
            payload = str(Path(folder) / f"{REQUEST_ID}.safetensors")
        results.put(pickle.dumps({"payload": payload}))
        jobs.get()  # the decode side is done with it
    except BaseException as e:  # noqa: BLE001 - reported to the demo, which prints one line
        results.put(pickle.dumps({"error": f"{type(e).__name__}: {e}"}))
    finally:
        if held is not None:
            held.release()
        if receiver is not None:
            receiver.close()  # (removes the arena's file)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _opened(payload):
    """The export a receiver's payload names: a held region's views, or a file read whole."""
    return payload.open() if isinstance(payload, RegionRef) else read_kv(payload)


def first_token(export) -> int:
    """The prefill's first token: the argmax of the logits that travelled with the KV (in
    the Mooncake region or the file; nothing recomputed)."""
    if export.last_logits is None:
        raise TransferError("the received KV holds no last_logits (the first token's logits): nothing to continue "
                            "from")
    return int(export.last_logits.argmax())


def _import_and_decode(group, spec: JobSpec, payload, steps: int) -> dict | None:
    """Every rank of the decode engine: import the request (from the receiver's shared
    arena in place, or its share of the file), then ``steps`` greedy decode steps from the
    first token its logits give (no recompute of the prompt)."""
    engine = make_engine(group, spec)
    export = payload.open() if isinstance(payload, RegionRef) else KVFile(payload)
    first = first_token(export)
    engine.release(engine.import_kv(export))  # warm: the model's fingerprint read once
    t0 = time.perf_counter()
    handle = engine.import_kv(export)
    imported = time.perf_counter() - t0
    held = [handle.local_tokens(r) for r in range(engine.parts.kv.cp_size)]
    tokens, times = [first], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = engine.decode([handle], [tokens[-1]])
        times.append(time.perf_counter() - t0)
        handle = step.handles[0]
        tokens.append(int(step.tokens[0]))  # the greedy next token, computed on the device
    engine.release(handle)
    if engine.world_rank != 0:
        return None
    warm = times[1:] or times  # (the first step captures its decode graph)
    return {"tokens": tokens, "import_s": imported, "first_step_s": times[0], "tokens_per_s": len(warm) / sum(warm),
            "held": held}


@torch.inference_mode()
def _transformers_decode(model_dir: Path, export, steps: int) -> dict:
    """The decode side for a model graphcp does not decode yet: transformers continues
    from the export's cache (the format's builder, graphcp.pd.load)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    cache = to_transformers_cache(export, dtype=torch.float32)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = first_token(export)
    tokens, _ = greedy_continue(model, cache, first, steps)
    return {"tokens": [first] + tokens, "import_s": built, "tokens_per_s": steps / (time.perf_counter() - t0)}


@torch.inference_mode()
def _reference(model_dir: Path, prompt: np.ndarray, steps: int) -> list[int]:
    """transformers alone: the greedy continuation of the prompt (first token included), an
    end-of-sequence id taken like any other, as the decode side's argmax takes it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt).view(1, -1)
    gen = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, eos_token_id=None)
    return gen[0, ids.shape[1]:].tolist()


#: the decode side's flags for the axes it sets under its own name
DECODE_FLAGS = {"kv_cache": "--decode-kv-cache"}
#: the decode side's cache modes, most preferred first (the ranks share every request's KV)
DECODE_CACHES = ("sharded", "layer-split", "replicated")


def decode_cache(kind: str) -> str:
    """The first of :data:`DECODE_CACHES` a model of ``kind`` decodes on (the last if none)."""
    return next((m for m in DECODE_CACHES if refusal({"model": kind, "kv_cache": m, "decode": "on"}) is None),
                DECODE_CACHES[-1])


def decode_spec(args: argparse.Namespace) -> JobSpec:
    """The decode side's run: ``--decode-cp`` ranks, ``--decode-kv-cache``, the other
    runtime flags as given (no stages, attention TP or DP; no bucket file: it is the
    prefill's)."""
    return job_spec(argparse.Namespace(**{**vars(args), "cp": args.decode_cp, "kv_cache": args.decode_kv_cache,
                                          "tp": None, "pp": 1, "pp_layers": None, "dp": 1, "buckets": None}))


def cmd_pd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("graphcp pd-demo checks the tokens against transformers, which is not installed "
                          "(pip install transformers)")
    problem = mooncake_problem() if args.transport != "file" else None
    if args.transport is None:  # the default: what this install can run
        args.transport = "mooncake" if problem is None else "file"
        if problem is not None:
            print(f"graphcp pd-demo: note: Mooncake is not importable here, so the KV goes through a file "
                  f"(--transport file); for Mooncake: {PD_EXTRA}", file=sys.stderr)
    elif problem is not None:
        raise ConfigError(f"--transport mooncake: {problem}; or use --transport file")
    if not 0 <= args.prefix_tokens < args.prompt_tokens:
        raise ConfigError(f"--prefix-tokens must be in [0, --prompt-tokens={args.prompt_tokens}), "
                          f"got {args.prefix_tokens}")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    spec = job_spec(args)
    model = preflight(spec, args.moe, "graphcp pd-demo")
    if args.decode_kv_cache is None:  # the default: the first cache mode the model decodes on
        args.decode_kv_cache = decode_cache(model.kind)
        if args.decode_kv_cache != DECODE_CACHES[0]:
            print(f"graphcp pd-demo: note: a {model.kind} model does not decode on a {DECODE_CACHES[0]} cache: the "
                  f"decode side uses --decode-kv-cache {args.decode_kv_cache}", file=sys.stderr)
    dspec = decode_spec(args)
    check_combination({**parallel_settings(spec.parallel), "export": "on"}, flags=True)
    # a model graphcp does not decode (or import) yet: the decode side is transformers, and says so
    rule = refusal({"model": model.kind, "decode": "on"}) or refusal({"model": model.kind, "import": "on"})
    instead = None if rule is None else rule.reason
    if instead is not None:
        print(f"graphcp pd-demo: note: graphcp does not decode this model ({instead}): the decode side continues "
              "with transformers", file=sys.stderr)
    else:
        with flags_named(DECODE_FLAGS):  # the decode side's refusals name its own flags
            preflight(dspec, args.moe, "graphcp pd-demo")
            check_import(dspec, model)
            check_decode(dspec, model)
    if args.memory_check:
        check_local_ranks_fit(spec, job_memory(spec, [args.prefix_tokens, args.prompt_tokens - args.prefix_tokens]))
        if instead is None:
            check_local_ranks_fit(dspec, job_memory(dspec, [args.prompt_tokens]))
    model_dir = resolve_model(spec.model)
    prompt = _prompt(model.vocab_size, args.prompt_tokens)
    ctx = mp.get_context("fork")
    ready, jobs, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    shm = shared_path()
    rx = ctx.Process(target=_receive_main, args=(args.transport, shm, ready, jobs, results, args.transfer_timeout,
                                                 os.getpid()), daemon=True)
    with sigint_deferred():  # a Ctrl-C as it forks is raised after (a daemon: it goes at exit)
        rx.start()
    try:
        where = ready.get(timeout=args.transfer_timeout + 60)
        res = run_job_on_ranks(_prefill_and_send, spec, prompt, args.prefix_tokens, args.transport, where,
                               args.transfer_timeout)
        jobs.put(True)
        got = pickle.loads(results.get(timeout=args.transfer_timeout + 120))
        if "error" in got:
            raise TransferError(f"the decode side's receiver failed: {got['error']}")
        if instead is None:
            dec = run_job_on_ranks(_import_and_decode, dspec, got["payload"], args.steps)
        else:
            dec = _transformers_decode(model_dir, _opened(got["payload"]), args.steps)
    except KeyboardInterrupt:
        rx.kill()  # Ctrl-C: at once, not after the receiver's wait
        raise
    finally:
        jobs.put(None)  # the receiver releases what it holds and exits
        rx.join(timeout=30)
        if rx.is_alive():
            rx.kill()
        if os.path.exists(shm):  # (a receiver killed before it removed its arena)
            os.unlink(shm)
    want = _reference(model_dir, prompt, args.steps)
    mine = dec["tokens"]
    ms = 1e3
    rows = [
        ("model", str(model_dir)),
        ("prefill", f"{ranks_of(spec)}, {spec.runtime.kv_cache} cache, {res['path']} path; prompt "
                    f"{args.prompt_tokens} tokens ({args.prefix_tokens} as a cached prefix); TTFT "
                    f"{res['ttft_s'] * ms:.1f} ms (warm)"),
        ("KV handed over", f"{res['bytes'] / 2**20:.2f} MiB via {args.transport} in {res['transfer_s'] * ms:.1f} ms "
                           f"({res['bytes'] / max(res['transfer_s'], 1e-9) / 2**30:.2f} GiB/s)"),
        ("decode", f"transformers: its cache built in {dec['import_s'] * ms:.1f} ms; {args.steps} steps at "
                   f"{dec['tokens_per_s']:.1f} tokens/s" if instead is not None else
                   f"{ranks_of(dspec)}, {dspec.runtime.kv_cache} cache: imported in {dec['import_s'] * ms:.1f} ms "
                   f"(tokens a rank: {'/'.join(map(str, dec['held']))}); {args.steps} steps: the first "
                   f"{dec['first_step_s'] * ms:.1f} ms, then {dec['tokens_per_s']:.1f} tokens/s"),
        ("graphcp tokens", " ".join(map(str, mine))),
        ("transformers alone", " ".join(map(str, want))),
        ("match", "yes" if mine == want else "NO"),
    ]
    print_table(rows)
    return 0 if mine == want else 1


def ranks_of(spec: JobSpec) -> str:
    """``CP 4`` (and its stages, attention TP, DP when it has them)."""
    p = spec.parallel
    extra = [f"PP {p.pp_size}"] * (p.pp_size > 1) + [f"attention TP {p.attn_tp_size}"] * (p.attn_tp_size > 1) \
        + [f"DP {p.dp_size}"] * (p.dp_size > 1)
    return " x ".join(extra + [f"CP {p.cp_size}"])
