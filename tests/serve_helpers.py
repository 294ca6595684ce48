"""A ``graphcp serve-prefill`` worker process, its clients and a decode side, for the
serve tests (tests/test_serve_prefill.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphcp import PrefillEngine, RuntimeConfig
from graphcp.pd.files import KVFile

ROOT = Path(__file__).resolve().parents[1]
#: seconds a worker may take to start (two ranks fork, build the engine and warm it) and to answer
START_S, REPLY_S = 120.0, 120.0


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class Worker:
    """``graphcp serve-prefill ARGS --listen 127.0.0.1:0`` in a process of its own; its
    first stdout line (the address) read."""

    def __init__(self, *args: str, session: bool = False) -> None:
        """``session``: in a process group of its own (:meth:`terminate` then signals the group)."""
        self.stderr = tempfile.TemporaryFile()
        self.session = session
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "graphcp", "serve-prefill", *args,
                                      "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env, cwd=ROOT, start_new_session=session)
        self.ready = self._line(START_S)
        assert self.ready.get("event") == "listening", self.ready
        host, port = self.ready["address"].rsplit(":", 1)
        self.address = (host, int(port))
        self.ranks = children(self.proc.pid)

    def _line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited ({self.proc.returncode}): {self.errors()}")
        raise AssertionError("the worker said nothing in time")

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def connect(self) -> "Conn":
        return Conn(self.address)

    def rss_kib(self) -> int:
        return rss_kib([self.proc.pid, *self.ranks])

    def terminate(self) -> tuple[int, dict]:
        """SIGTERM (to its process group, ranks included, when it has its own); the exit
        code and the exit report (its last stdout line)."""
        if self.session:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=START_S)
        lines = [json.loads(x) for x in out.decode().splitlines() if x.strip()]
        return self.proc.returncode, lines[-1] if lines else {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Conn:
    """One client connection: lines out, reply lines in."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=REPLY_S)
        self.file = self.sock.makefile("rb")

    def send(self, obj) -> None:
        self.sock.sendall(obj if isinstance(obj, bytes) else (json.dumps(obj) + "\n").encode())

    def recv(self) -> dict:
        line = self.file.readline()
        assert line, "the worker closed the connection"
        return json.loads(line)

    def ask(self, obj) -> dict:
        self.send(obj)
        return self.recv()

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def request(rid: str, decode: Path | str, tokens) -> dict:
    return {"id": rid, "decode": str(decode), "tokens": [int(t) for t in tokens]}


def decode_engine(model_dir: Path, kv_tokens: int = 8192) -> PrefillEngine:
    """The decode side: one rank, a replicated cache (another shape than the worker's)."""
    return PrefillEngine(model_dir, RuntimeConfig(kv_cache="replicated", kv_tokens=kv_tokens, graph="off"))


def continue_file(engine: PrefillEngine, path, steps: int) -> list[int]:
    """Import the request's KV (a file's path, or an export a receiver handed out) and
    greedy-decode: its first token (the payload's last_logits: nothing recomputed) and
    ``steps - 1`` more; the handle released."""
    kv = KVFile(path) if isinstance(path, Path) else path
    handle = engine.import_kv(kv)
    tokens = [int(kv.last_logits.argmax())]
    for _ in range(steps - 1):
        step = engine.decode([handle], [tokens[-1]])
        handle = step.handles[0]
        tokens.append(int(step.tokens[0]))
    engine.release(handle)
    return tokens


def decode_side(model_dir: Path, inbox: Path, outbox: Path, steps: int) -> None:
    """A decode process: each request file that lands in ``inbox`` is imported and
    continued (:func:`continue_file`), its tokens written to ``outbox/<id>.json`` and the
    file removed; until killed."""
    torch.set_num_threads(1)
    engine = decode_engine(model_dir)
    while True:
        files = sorted(inbox.glob("*.safetensors"))
        for f in files:
            tokens = continue_file(engine, f, steps)
            tmp = outbox / f".{f.stem}.tmp"
            tmp.write_text(json.dumps({"tokens": tokens, "free_pages": engine.parts.kv.num_free_pages}))
            tmp.rename(outbox / f"{f.stem}.json")
            f.unlink()
        if not files:
            time.sleep(0.02)


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[np.ndarray]:
    """``n`` prompts of log-uniform lengths in [lo, hi]."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)
    return [rng.integers(0, vocab, int(length)) for length in lengths]


def _receiver_main(ready, results, dies: bool) -> None:
    """A Mooncake decode side: a KVReceiver whose requests go to ``results`` as they
    complete (``(id, export)``); ``dies``: the process ends after its first ``open``."""
    torch.set_num_threads(1)
    from graphcp.pd.receiver import KVReceiver

    class DiesAfterOpen(KVReceiver):
        def _handle(self, ch, msg):
            super()._handle(ch, msg)
            if msg.get("op") == "open":
                os._exit(3)

    rx = (DiesAfterOpen if dies else KVReceiver)(64 << 20, timeout_s=30)
    ready.put(rx.address)
    while True:
        for rid in rx.completed():
            results.put((rid, rx.get(rid)))
        time.sleep(0.02)


class Receiver:
    """A Mooncake receiver in a process of its own (:func:`_receiver_main`)."""

    def __init__(self, dies: bool = False) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        ready, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver_main, args=(ready, self.results, dies), daemon=True)
        self.proc.start()
        self.address = ready.get(timeout=START_S)

    def get(self) -> tuple[str, object]:
        return self.results.get(timeout=REPLY_S)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
