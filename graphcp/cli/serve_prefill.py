"""``graphcp serve-prefill``: a prefill worker that stays up (graphcp.serve; docs/pd.md,
"serve-prefill"). The flags, the model and the listen address are checked before any
rank starts (exit 2); the ranks then serve until SIGTERM (or Ctrl-C: exit 130), and the
command prints the exit report as its last stdout line: the requests served, failed and
refused, and every rank's free KV pages at the start and at the end (exit 1 if they differ)."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import sys

from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.dist import rank_start_method
from graphcp.errors import ConfigError
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec, preflight
from graphcp.jobs.spec import run_job_on_ranks
from graphcp.pd.mooncake import mooncake_problem
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.serve.frontend import listen
from graphcp.serve.worker import ServeOptions, serve_job


def check_listen(host: str, port: int) -> None:
    """``--listen``: an address this machine can bind now (ConfigError, exit 2, before any
    rank starts; rank 0 binds it again)."""
    try:
        with listen(host, port):
            pass
    except OSError as e:
        raise ConfigError(f"--listen {host}:{port}: cannot listen there ({type(e).__name__}: {e})") from None


def cmd_serve_prefill(args) -> int:
    if args.transport == "mooncake":
        problem = mooncake_problem()
        if problem is not None:
            raise ConfigError(f"--transport mooncake: {problem}; or use --transport file")
    spec = job_spec(args)
    check_combination({**parallel_settings(spec.parallel), "export": "on"}, flags=True)
    model = preflight(spec, args.moe, "graphcp serve-prefill")
    host, port = args.listen
    check_listen(host, port)
    if args.memory_check:  # a batch of the largest bucket's rows on every rank
        largest = (spec.buckets() or BucketSet()).largest
        check_local_ranks_fit(spec, job_memory(spec, [min(largest * spec.cp_size, model.max_position_embeddings)]))
    opts = ServeOptions(args.transport, host, port, args.batch_wait_ms / 1e3, args.transfer_timeout)
    stop = mp.get_context(rank_start_method(spec.runtime.device)).Event()
    before = signal.signal(signal.SIGTERM, lambda sig, frame: stop.set())
    try:
        report = run_job_on_ranks(serve_job, spec, opts, stop)
    finally:
        signal.signal(signal.SIGTERM, before)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    if report["leaked_pages"]:
        print(f"graphcp serve-prefill: {report['leaked_pages']} KV pages were not given back (free pages "
              f"{report['start_free_pages']} at the start, {report['free_pages']} at the end): a bug", file=sys.stderr)
        return 1
    return 0

