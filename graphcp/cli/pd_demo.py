"""``graphcp pd-demo``: one prefill/decode round trip on this machine.

A receiver process (the decode side) starts a :class:`KVReceiver`; graphcp prefills a
prompt at CP N (a cached prefix first, then the rest extending it), and every rank
sends its part of the request's KV straight into the receiver's memory through the
Mooncake transfer engine on loopback TCP (``--transport file``: one safetensors file
instead). The receiver builds a transformers model from the same checkpoint, takes
the received KV as its cache and continues the request greedily from graphcp's first
token; the demo prints the tokens and whether they match transformers run alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphcp.cli.table import print_table
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.dist import die_with_parent, ignore_sigint, sigint_deferred
from graphcp.errors import ConfigError
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec, preflight
from graphcp.jobs.spec import JobSpec, make_engine, run_job_on_ranks
from graphcp.model.presets import resolve_model
from graphcp.pd.errors import TransferError
from graphcp.pd.files import save_kv
from graphcp.pd.hf import greedy_continue
from graphcp.pd.load import load_kv, to_transformers_cache
from graphcp.pd.mooncake import PD_EXTRA, mooncake_problem
from graphcp.pd.receiver import KVReceiver
from graphcp.pd.sender import KVSender
from graphcp.runtime.engine import prefill_after_prefixes

REQUEST_ID = "demo-0"


def _prompt(vocab: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, n)


def _prefill_and_send(group, spec: JobSpec, prompt: np.ndarray, prefix: int, transport: str, where: str,
                      timeout_s: float) -> dict | None:
    """Every rank: prefill the prompt (prefix first), then hand its KV to the decode side."""
    engine = make_engine(group, spec)
    out = prefill_after_prefixes(engine, [(prompt[:prefix] if prefix else None, prompt[prefix:])])
    handle = out.handles[0]
    t0 = time.perf_counter()
    if transport == "mooncake":
        sender = KVSender(where, engine.world_rank, engine.world.size, timeout_s=timeout_s)
        sender.send(engine, [handle], [REQUEST_ID])
        sender.close()
    else:
        export = engine.export_kv(handle, dst=0)
        if export is not None:
            save_kv(export, Path(where) / f"{REQUEST_ID}.safetensors")
    took = time.perf_counter() - t0
    meta = engine.kv_meta(handle)
    engine.release(handle)  # acknowledged (or written): the prefill side lets it go
    if group.rank != 0:
        return None
    return {"next_token": int(out.last_logits[0].argmax()), "bytes": meta.nbytes, "transfer_s": took,
            "pool_bytes": engine.parts.kv.pool_bytes, "path": out.info.path}


def _decode_main(model_dir: str, transport: str, ready, jobs, results, timeout_s: float, parent_pid: int) -> None:
    """The decode process: receive the request's KV, continue it with transformers."""
    die_with_parent(parent_pid)  # as the ranks: a killed pd-demo takes it with it
    ignore_sigint()  # Ctrl-C is the command's to handle: it kills this process
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    try:
        receiver = KVReceiver(256 << 20, timeout_s=timeout_s) if transport == "mooncake" else None
        folder = tempfile.mkdtemp(prefix="graphcp-pd-") if receiver is None else None
        ready.put(receiver.address if receiver is not None else folder)
        job = jobs.get()
        if job is None:
            return
        next_token, steps = job
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bars are not the demo's output

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if receiver is not None:
            cache = to_transformers_cache(receiver.get(REQUEST_ID), dtype=torch.float32)
        else:
            export = load_kv(Path(folder) / f"{REQUEST_ID}.safetensors").export
            cache = to_transformers_cache(export, dtype=torch.float32)
        received = cache.get_seq_length()
        tokens, _ = greedy_continue(model, cache, next_token, steps)
        results.put(pickle.dumps({"tokens": tokens, "received_tokens": received}))
    except BaseException as e:  # noqa: BLE001 - reported to the demo, which prints one line
        results.put(pickle.dumps({"error": f"{type(e).__name__}: {e}"}))


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


def cmd_pd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("graphcp pd-demo continues the request with transformers, which is not installed "
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
    preflight(spec, args.moe, "graphcp pd-demo")
    check_combination({**parallel_settings(spec.parallel), "export": "on"}, flags=True)
    if args.memory_check:
        check_local_ranks_fit(spec, job_memory(spec, [args.prefix_tokens, args.prompt_tokens - args.prefix_tokens]))
    model_dir = resolve_model(spec.model)
    from graphcp.model.config import ModelConfig

    prompt = _prompt(ModelConfig.from_file(model_dir / "config.json").vocab_size, args.prompt_tokens)
    ctx = mp.get_context("fork")
    ready, jobs, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    decode = ctx.Process(target=_decode_main, args=(str(model_dir), args.transport, ready, jobs, results,
                                                   args.transfer_timeout, os.getpid()), daemon=True)
    with sigint_deferred():  # a Ctrl-C as it forks is raised after (a daemon: it goes at exit)
        decode.start()
    try:
        where = ready.get(timeout=args.transfer_timeout + 60)
        res = run_job_on_ranks(_prefill_and_send, spec, prompt, args.prefix_tokens, args.transport, where,
                               args.transfer_timeout)
        jobs.put((res["next_token"], args.steps))
        got = pickle.loads(results.get(timeout=args.transfer_timeout + 120))
    except KeyboardInterrupt:
        decode.kill()  # Ctrl-C: at once, not after the decode side's wait
        raise
    except BaseException:
        jobs.put(None)
        raise
    finally:
        decode.join(timeout=30)
        if decode.is_alive():
            decode.kill()
    if "error" in got:
        raise TransferError(f"the decode process failed: {got['error']}")
    want = _reference(model_dir, prompt, args.steps)
    mine = [res["next_token"]] + got["tokens"]
    rows = [
        ("model", str(model_dir)),
        ("prefill", f"{spec.cp_size} ranks, {spec.runtime.kv_cache} cache, {res['path']} path; prompt "
                    f"{args.prompt_tokens} tokens ({args.prefix_tokens} as a cached prefix)"),
        ("KV handed over", f"{res['bytes'] / 2**20:.2f} MiB via {args.transport} in {res['transfer_s'] * 1e3:.1f} ms "
                           f"({res['bytes'] / max(res['transfer_s'], 1e-9) / 2**30:.2f} GiB/s); the decode side "
                           f"holds {got['received_tokens']} tokens"),
        ("graphcp + decode tokens", " ".join(map(str, mine))),
        ("transformers alone", " ".join(map(str, want))),
        ("match", "yes" if mine == want else "NO"),
    ]
    print_table(rows)
    return 0 if mine == want else 1



