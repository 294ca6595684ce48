"""Process groups, the collectives graphcp uses, and launching ranks.

One process per rank. Ranks come from ``torchrun`` (multi-node too: the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment) or from :func:`launch`,
graphcp's own launcher for one machine. gloo on CPU, nccl on CUDA.

Failure handling: every collective runs under the group's timeout; a collective
that fails (a peer died, or the timeout passed) raises :class:`CollectiveError`
naming this rank, the collective and the cause. :func:`launch` watches its
children and raises :class:`RankFailure` naming the rank that died first and why.
Launched ranks never outlive their launcher: Ctrl-C reaches the launcher alone
(ranks ignore SIGINT), which stops every rank at once before it re-raises; a
launcher that is killed takes its ranks with it (a parent-death signal, or a
watchdog where the system has none).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import pickle
import queue as queue_mod
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import _disable_current_modes

from graphcp.errors import ConfigError, GraphcpError, one_line


class CollectiveError(GraphcpError, RuntimeError):
    """A collective over the CP group, or a point-to-point transfer between pipeline
    stages, failed: a peer rank died or timed out."""


class RankFailure(GraphcpError, RuntimeError):
    """A launched rank died or raised. The message is one line naming the rank that
    failed first and what it raised; ``cause`` is that exception (when it could be sent
    back), ``tracebacks`` each failing rank's traceback (``graphcp --debug`` prints
    them), ``others`` what every other failing rank reported (the message counts them),
    and ``rank_bug`` says the rank raised something that is not a graphcp error (a bug:
    the command line lets it surface with its traceback)."""

    def __init__(self, message: str, cause: BaseException | None = None, tracebacks: dict[int, str] | None = None,
                 rank_bug: bool = False, others: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.tracebacks = tracebacks or {}
        self.rank_bug = rank_bug
        self.others = others or {}


def _error_report(e: BaseException) -> dict:
    """What a rank sends back about its exception: picklable, whatever ``e`` is."""
    try:
        cause = pickle.dumps(e)
        pickle.loads(cause)  # an exception whose class cannot be rebuilt is sent as text only
    except Exception:  # noqa: BLE001
        cause = None
    return {"summary": f"{type(e).__name__}: {one_line(e)}", "cause": cause, "traceback": traceback.format_exc(),
            "graphcp": isinstance(e, GraphcpError), "collective": isinstance(e, CollectiveError)}


def short_cause(e: BaseException, limit: int = 100) -> str:
    """What a backend said went wrong, short: its first sentence without the source
    location it starts with (gloo: ``[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:42919. This is typically caused by ...``)."""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", one_line(e))
    text = re.split(r"\.\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(".")
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(e).__name__}: {text}"


def wait_work(work, timeout_s: float | None = None) -> None:
    """Wait for a collective with Python dispatch modes paused: what the wait
    dispatches is part of the collective (a graph recorder replays the collective
    and waits on it again), not ops of its own."""
    if work is None:
        return
    with _disable_current_modes():
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))


# torch 2.13 renamed these (the old names warn); older releases only have the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _async(x: torch.Tensor) -> bool:
    # CPU (gloo, the trace recorder): issue async and wait with modes paused. CUDA
    # (nccl, possibly under CUDA-graph capture): the plain synchronous call, the form
    # NCCL graph capture is known to support
    return x.device.type != "cuda"


@dataclass
class CPGroup:
    """The CP group (= the TP group of the MLP). Size 1 makes every collective a no-op."""

    rank: int = 0
    size: int = 1
    pg: Any = None  # a torch.distributed ProcessGroup, None for the default group
    timeout_s: float = 300.0
    #: what the group is, for error messages (a stage's CP group, every rank of a pipeline)
    name: str = "CP group"
    #: this process's rank in the default group, when the group is a sub-group of it
    global_rank: int | None = None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def _fail(self, op: str, e: Exception) -> CollectiveError:
        return self.failure(op, e)

    def failure(self, op: str, e: BaseException) -> CollectiveError:
        """The one-line error of ``op`` over this group failing with ``e`` (what every
        collective raises; a replayed graph's watchdog raises the same)."""
        where = "" if self.global_rank is None else f" (global rank {self.global_rank})"
        return CollectiveError(
            f"rank {self.rank}/{self.size}{where}: {op} over the {self.name} failed "
            f"(a peer rank died or did not arrive within {self.timeout_s:g}s): {short_cause(e)}"
        )

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [size * n, ...], rank-major."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            wait_work(_all_gather(out, x.contiguous(), group=self.pg, async_op=_async(x)))
        except Exception as e:  # noqa: BLE001 - re-raised with the rank and the op named
            raise self._fail("all_gather", e) from e
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size * n, ...] partial sums -> this rank's [n, ...] block of the sum."""
        if self.size == 1:
            return x
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            wait_work(_reduce_scatter(out, x.contiguous(), op=dist.ReduceOp.SUM, group=self.pg,
                                      async_op=_async(x)))
        except Exception as e:  # noqa: BLE001
            raise self._fail("reduce_scatter", e) from e
        return out

    def send_recv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> "Pending":
        """Post a send of ``send`` to rank ``dst`` and a receive into ``recv`` from rank
        ``src`` (point-to-point, one batch: a ring step); either may be None (nothing
        that way; both sides must agree). Returns at once: ``wait()`` completes both, so
        work can overlap the transfer."""
        ops = []  # P2POp's peer is a global rank even with group= (a group's own rank: group_peer=)
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self._global(dst), group=self.pg))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self._global(src), group=self.pg))
        if self.size == 1 or not ops:
            return Pending(self, [])
        try:
            return Pending(self, dist.batch_isend_irecv(ops))
        except Exception as e:  # noqa: BLE001
            raise self._fail("send/recv", e) from e

    def all_to_all_rows(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``x[sum(send_rows[:k]) ...][:send_rows[k]]`` go to rank k; returns the
        rows every rank sent here, rank-major (``recv_rows[k]`` from rank k; uneven splits,
        zeros too), in ``out`` when given. The split sizes are host integers, so a
        captured graph cannot hold this call."""
        if out is None:
            out = torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.size == 1:
            return out.copy_(x)
        try:
            wait_work(dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=self.pg,
                                             async_op=_async(x)))
        except Exception as e:  # noqa: BLE001
            raise self._fail("all_to_all", e) from e
        return out

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size == 1:
            return x
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        try:
            wait_work(dist.all_reduce(x, op=rop, group=self.pg, async_op=_async(x)))
        except Exception as e:  # noqa: BLE001
            raise self._fail("all_reduce", e) from e
        return x

    def broadcast_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """``x`` of rank ``src`` into ``x`` on every rank (same shape and dtype everywhere)."""
        if self.size == 1:
            return x
        try:
            wait_work(dist.broadcast(x, src=self._global(src), group=self.pg, async_op=_async(x)))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"broadcast from global rank {self._global(src)}", e) from e
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point: ``x`` (contiguous) to rank ``dst``, which calls :meth:`recv_`."""
        try:
            wait_work(dist.isend(x.contiguous(), dst=self._global(dst), group=self.pg))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"send to rank {dst}", e) from e

    def recv_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Point-to-point: fill ``x`` (contiguous) with what rank ``src`` sends."""
        try:
            wait_work(dist.irecv(x, src=self._global(src), group=self.pg))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"recv from rank {src}", e) from e
        return x

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (collectives name global ranks)."""
        return rank if self.pg is None else dist.get_global_rank(self.pg, rank)


def host_group(group: CPGroup) -> CPGroup:
    """``group``'s ranks over gloo: collectives of host tensors that never wait for a
    device (a consistency fingerprint). The group itself when it is gloo already (a CPU
    engine) or of one rank; otherwise a gloo group of the same ranks, made by its members
    alone (``use_local_synchronization``: no other rank of the job takes part)."""
    if not group.distributed or dist.get_backend(group.pg) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group.pg if group.pg is not None else dist.group.WORLD)
    pg = dist.new_group(ranks, timeout=timedelta(seconds=group.timeout_s), backend="gloo",
                        use_local_synchronization=True)
    return CPGroup(group.rank, group.size, pg, group.timeout_s, f"{group.name} (gloo)", group.global_rank)


def new_subgroups(world: CPGroup, members: list[list[int]], name: str) -> CPGroup:
    """Split ``world`` into the disjoint sub-groups ``members`` (lists of global ranks)
    and return the one this rank belongs to. Every rank of ``world`` must call it with
    the same lists (torch.distributed creates every group on every rank, in order)."""
    mine = next(i for i, m in enumerate(members) if world.rank in m)
    pg = None
    for i, m in enumerate(members):
        g = dist.new_group(m, timeout=timedelta(seconds=world.timeout_s)) if len(m) > 1 else None
        if i == mine:
            pg = g
    ranks = members[mine]
    return CPGroup(ranks.index(world.rank), len(ranks), pg, world.timeout_s, name.format(index=mine), world.rank)


@dataclass
class PeerLink:
    """A point-to-point link from this rank to one peer (global ranks), for the hidden
    rows pipeline stages hand on. Transfers are asynchronous (a stage's send does not
    hold up its next micro-batch) and waited under the timeout: a dead or late peer
    is a :class:`CollectiveError` naming both ends."""

    rank: int
    peer: int
    timeout_s: float
    #: the peer as error messages name it, e.g. "stage 1 (global rank 3)"
    peer_name: str

    def isend(self, x: torch.Tensor, tag: int = 0) -> "PendingTransfer":
        x = x.contiguous()
        return self._start("send to", lambda: dist.isend(x, self.peer, tag=tag), x)

    def irecv(self, out: torch.Tensor, tag: int = 0) -> "PendingTransfer":
        return self._start("receive from", lambda: dist.irecv(out, self.peer, tag=tag), out)

    def _start(self, op: str, start: Callable[[], Any], x: torch.Tensor) -> "PendingTransfer":
        try:
            work = start()
        except Exception as e:  # noqa: BLE001
            raise self.fail(op, e) from e
        return PendingTransfer(self, op, work, x)

    def fail(self, op: str, e: Exception) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank}: {op} {self.peer_name} failed (the peer died or did not arrive within "
            f"{self.timeout_s:g}s): {short_cause(e)}"
        )


@dataclass
class PendingTransfer:
    """An asynchronous send or receive; holds its tensor until waited."""

    link: PeerLink
    op: str
    work: Any
    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        # gloo: a host wait under the timeout. NCCL: a stream-ordered wait (an explicit
        # timeout would block the host), its watchdog enforcing the process group's timeout
        timeout = self.link.timeout_s if self.tensor.device.type != "cuda" else None
        try:
            wait_work(self.work, timeout)
        except Exception as e:  # noqa: BLE001
            raise self.link.fail(self.op, e) from e
        return self.tensor


@dataclass
class Pending:
    """Posted point-to-point transfers of one ring step (:meth:`CPGroup.send_recv`)."""

    group: CPGroup
    works: list

    def wait(self) -> None:
        try:
            for w in self.works:
                wait_work(w)
        except Exception as e:  # noqa: BLE001
            raise self.group._fail("send/recv", e) from e
        self.works = []


# ---- process-group set-up -------------------------------------------------------
def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def local_ranks(world_size: int) -> int:
    """The ranks of a ``world_size`` run on this machine: under torchrun its node's
    (``LOCAL_WORLD_SIZE``), else all of them (graphcp's own launcher is one machine)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return world_size


def check_devices(device: str, ranks: int, asked: str | None = None, cpu: str = "device 'cpu'") -> None:
    """Refuse, before any rank starts, a CUDA run this machine cannot hold: a torch built
    without CUDA, no visible GPU, or more ranks on this machine than GPUs (one GPU a rank:
    NCCL refuses two ranks on one device, "Duplicate GPU detected", so every rank would load
    the model and die at its first collective). ``ranks``: the ranks this machine runs;
    ``asked``, ``cpu``: how the caller asked for them and how it says "the CPU" (the
    command line's flags), for the message."""
    if not device.startswith("cuda"):
        return
    what = asked or f"device {device!r}"
    if torch.version.cuda is None and torch.version.hip is None:
        raise ConfigError(f"{what}: this torch ({torch.__version__}) is built without CUDA; run on the CPU "
                          f"({cpu}) or install a CUDA build of torch")
    seen = torch.cuda.device_count()
    if seen == 0:
        raise ConfigError(f"{what}: no CUDA device is visible (torch.cuda.device_count() is 0; check "
                          "CUDA_VISIBLE_DEVICES and the driver)")
    if ranks > seen:
        raise ConfigError(f"{what}: {ranks} ranks on this machine but {seen} GPU(s) visible; the mesh needs one GPU "
                          f"a rank (NCCL refuses two ranks on one GPU): ask for at most {seen} ranks, or run on a "
                          "machine with more GPUs")


def init_from_env(device: str = "cpu", timeout_s: float = 300.0) -> CPGroup:
    """Join the group described by torchrun's environment (or a size-1 group)."""
    if dist.is_initialized():
        return CPGroup(dist.get_rank(), dist.get_world_size(), None, timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_devices(device, local_ranks(world))
    if world == 1:
        return CPGroup(0, 1, None, timeout_s)
    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(default_backend(device), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return CPGroup(rank, world, None, timeout_s)


def free_port() -> int:
    """A port free now; another process may bind it before the caller does (for tests
    and tools that must name a port up front: ``launch`` binds its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- ranks live and die with their launcher -----------------------------------------
# Ctrl-C: a terminal sends SIGINT to the whole foreground process group, and a user (or
# ``timeout -s INT``) may signal the launcher alone. Either way only the launcher acts on
# it: ranks start with SIGINT blocked and then ignore it, and the launcher stops every rank
# at once before it re-raises. A Ctrl-C while ranks start is held and acted on once they
# have (never lost: it was, and a run went on to the end). A launcher killed outright
# (kill -9, the OOM killer) runs no code: each rank asks the kernel for SIGKILL when its
# parent dies (Linux PR_SET_PDEATHSIG), or elsewhere watches its parent from a thread. On
# GPUs an orphaned rank would go on holding its device.
PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: how often a rank without a parent-death signal checks its parent
WATCH_PARENT_S = 0.5


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread inside: one that comes waits, pending, until the
    block ends. A child started inside inherits the block (``fork`` and ``exec`` both
    hand the mask down) and keeps it until it ignores SIGINT (:func:`ignore_sigint`): a
    Ctrl-C to the process group while it starts (a spawned interpreter's torch import)
    is dropped there, with no KeyboardInterrupt traceback."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the mask as it is (blocking nothing)
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a pending SIGINT is delivered here


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Code inside runs whole: a Ctrl-C meanwhile is neither lost nor raised in the
    middle (a child forked but not yet known, a rank half stopped); it is acted on as
    the block ends, as if it came then (KeyboardInterrupt under Python's handler, nothing
    where SIGINT is ignored). SIGINT is blocked in this thread (see
    :func:`_sigint_blocked`, which children inherit); one that another thread takes
    meanwhile (torch's, OpenMP's) is noted by a handler that only notes it, and sent again
    once the handler before is back."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        with _sigint_blocked():
            yield
        return
    came: list[int] = []
    before = signal.signal(signal.SIGINT, lambda sig, frame: came.append(sig))
    try:
        with _sigint_blocked():
            yield
    finally:
        signal.signal(signal.SIGINT, before)
    if came:
        signal.raise_signal(signal.SIGINT)


def ignore_sigint() -> None:
    """First thing in a process a command starts: SIGINT ignored, then unblocked (the
    launcher started it blocked: a Ctrl-C that came meanwhile is dropped). Ctrl-C is the
    launcher's to handle: it stops its children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a rank (or any helper process a command starts): end this
    process when ``parent_pid`` (the launcher) dies. SIGKILL: nothing a rank holds is
    worth finishing once nobody reads its result."""
    if not _parent_death_signal(signal.SIGKILL):
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(WATCH_PARENT_S)
            os._exit(1)

        threading.Thread(target=watch, name="graphcp-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the launcher died before the signal was asked for
        os._exit(1)


def _join_all(procs: Sequence[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def _stop(procs: Sequence[Any], wait_s: float, grace_s: float = 1.0) -> None:
    """Let ``procs`` (started multiprocessing Processes) exit on their own for up to
    ``wait_s`` seconds in all, then stop the rest: SIGTERM, and SIGKILL for any still
    alive ``grace_s`` later. A Ctrl-C cuts the first wait short; the stopping itself
    runs whole (a rank left running would hold the launcher's exit: multiprocessing
    joins its children then)."""
    try:
        _join_all(procs, wait_s)
    finally:
        with sigint_deferred():
            alive = [p for p in procs if p.is_alive()]
            for p in alive:
                p.terminate()
            _join_all(procs, grace_s if alive else 0.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()


def _rank_main(rank, size, store_port, backend, timeout_s, fn, args, results, threads, launcher_pid) -> None:
    die_with_parent(launcher_pid)  # a killed launcher takes its ranks with it
    ignore_sigint()  # Ctrl-C is the launcher's to handle (see above)
    torch.set_num_threads(threads)
    try:
        port, port_set = store_port
        if not port_set.wait(timeout_s):
            raise RuntimeError(f"the launcher's rendezvous store did not start within {timeout_s:g} s")
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value))
        if backend == "nccl":  # one GPU a rank (launch checked there are enough); "cuda": this rank's
            torch.cuda.set_device(rank)
        # a client of the launcher's store (see launch): no rank binds a port of its own
        store = dist.TCPStore("127.0.0.1", port.value, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        group = CPGroup(rank, size, None, timeout_s)
        out = fn(group, *args)
        # by value: shared-memory handles would die with this process
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        results.put((rank, "error", _error_report(e)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer can make teardown fail
                pass


def _others(others: dict[int, str]) -> str:
    """The other failing ranks in the one-line message: one is named with its reason,
    more are counted (64 killed ranks made a message of several KB; ``RankFailure.others``
    keeps each, and --debug prints their tracebacks)."""
    if len(others) == 1:
        (r, summary), = others.items()
        return f" (also rank {r}: {summary})"
    if others:
        ranks = sorted(others)
        return f" (and {len(ranks)} other ranks: {', '.join(map(str, ranks[:4]))}{', ...' if len(ranks) > 4 else ''})"
    return ""


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = 300.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``nprocs`` local ranks; return each rank's result.

    Uses ``fork`` on CPU (fast; never after CUDA is initialised) and ``spawn``
    otherwise. If a rank dies or raises, the others are stopped and
    :class:`RankFailure` names the first rank that failed and why. Ctrl-C (or anything
    else that stops this process) stops every rank at once, and a killed launcher
    takes its ranks with it.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    check_devices(device, nprocs)
    if start_method is None:
        cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
        start_method = "fork" if device == "cpu" and not cuda_live else "spawn"
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    # the launcher hosts the ranks' rendezvous store on a port the OS picks as it binds
    # (a port picked free and bound later by rank 0 could be taken in between by another
    # job on the node: rank 0 then failed and the others waited out their timeout). It
    # starts after the ranks are forked: its server thread may hold a libc lock (name
    # lookup) at the moment of a fork, and a child that inherits it hangs
    port, port_set = ctx.Value("i", 0), ctx.Event()
    store = None
    backend = default_backend(device)
    # a forked rank runs one intra-op thread: libgomp cannot start a thread team in a
    # forked child of a process that ran one (the child waits forever for the parent's
    # workers: launch(fn, 1) after any multi-threaded op in the caller hung)
    threads = 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // nprocs)
    procs = [
        ctx.Process(target=_rank_main, daemon=False, args=(r, nprocs, (port, port_set), backend, timeout_s, fn, args,
                                                           results, threads, os.getpid()))
        for r in range(nprocs)
    ]
    started: list[Any] = []
    outputs: dict[int, Any] = {}
    errors: list[tuple[float, int, str]] = []
    deadline_after_failure: float | None = None
    interrupted = True  # until the loop ends on its own: Ctrl-C (or anything raised) stops every rank at once
    try:
        with sigint_deferred():  # a Ctrl-C while ranks start is raised once all have (it stops them)
            for p in procs:
                p.start()
                started.append(p)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        port.value = store.port
        port_set.set()
        while len(outputs) + len(errors) < nprocs:
            try:
                rank, status, payload = results.get(timeout=0.05)
                if status == "ok":
                    outputs[rank] = pickle.loads(payload)
                else:
                    errors.append((time.monotonic(), rank, payload))
                continue
            except queue_mod.Empty:
                pass
            reported = set(outputs) | {r for _, r, _ in errors}
            for r, p in enumerate(procs):
                if r not in reported and not p.is_alive():
                    # died without reporting: killed, or crashed in C
                    time.sleep(0.05)  # its last message may still be in the pipe
                    if results.empty():
                        how = f"killed by signal {-p.exitcode}" if (p.exitcode or 0) < 0 else f"exit code {p.exitcode}"
                        errors.append((time.monotonic(), r, {"summary": f"rank {r} died ({how}) without reporting",
                                                             "cause": None, "traceback": "", "graphcp": True,
                                                             "collective": False}))
                    break
            if errors and deadline_after_failure is None:
                # survivors should fail fast through CollectiveError; don't wait past the timeout
                deadline_after_failure = time.monotonic() + timeout_s + 10
            if deadline_after_failure is not None and time.monotonic() > deadline_after_failure:
                break
        interrupted = False
    finally:
        _stop(started, wait_s=0 if interrupted else 1 if errors else 5)
        del store  # its server stops with the ranks
    if errors:
        # the cause is a rank that died or raised on its own; a CollectiveError is a
        # survivor noticing it (and may reach the queue first)
        errors.sort(key=lambda e: (e[2]["collective"], e[0]))
        first_rank, first = errors[0][1], errors[0][2]
        cause = pickle.loads(first["cause"]) if first["cause"] is not None else None
        others = {r: rep["summary"] for _, r, rep in errors[1:]}
        raise RankFailure(
            f"rank {first_rank} failed first: {first['summary']}" + _others(others),
            cause, {r: rep["traceback"] for _, r, rep in errors if rep["traceback"]}, rank_bug=not first["graphcp"],
            others=others,
        )
    return [outputs[r] for r in range(nprocs)]


# ---- helpers for per-rank jobs ----------------------------------------------------
def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
              timeout_s: float = 300.0) -> Any:
    """Run ``fn(group, *args)`` on every rank of a run (``world_size`` = pp_size x
    tp_size ranks: tp_size = cp_size without attention TP or DP); return rank 0's result.

    Under torchrun (``WORLD_SIZE`` set) this process is one rank and joins the group;
    otherwise ``world_size`` local ranks are launched (1 runs in-process).
    """
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        group = init_from_env(device, timeout_s)
        if group.size != world_size:
            raise ConfigError(f"this run needs {world_size} ranks (pp_size x tp_size) but torchrun started "
                              f"{group.size}")
        return fn(group, *args)
    if world_size == 1:
        check_devices(device, 1)
        return fn(CPGroup(), *args)
    return launch(fn, world_size, *args, device=device, timeout_s=timeout_s)[0]


def barrier(group: CPGroup) -> None:
    """Every rank of ``group`` arrives (CollectiveError, like every collective, when a
    peer died: the first failing rank's own error is then reported first)."""
    if group.distributed:
        try:
            dist.barrier(group=group.pg)
        except Exception as e:  # noqa: BLE001
            raise group._fail("barrier", e) from e


def gather_object(group: CPGroup, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not group.distributed:
        return [obj]
    out: list[Any] = [None] * group.size
    try:
        dist.all_gather_object(out, obj, group=group.pg)
    except Exception as e:  # noqa: BLE001
        raise group._fail("all_gather_object", e) from e
    return out
