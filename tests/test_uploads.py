"""Host-to-device uploads a forward makes (graphcp/attention/staging.py): every host array
goes through ``staging.to_device`` (pinned, queued without blocking the host on a GPU),
once a forward; nothing in a forward uploads on its own (a ``tensor.to(device)`` or
``torch.tensor(host data, device=...)`` from pageable memory blocks the host on CUDA until
the stream drains). Counted on the CPU: a recorder stands in for the uploads
(``tests/fake_copy_engine.py``), a torch-function mode catches the direct ones.
DeepSeek V4's reference attention uploads per forward, not per layer and 256-row block."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from fake_copy_engine import UploadRecorder
from torch.overrides import TorchFunctionMode

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.attention import staging
from graphcp.model.presets import ensure_preset
from graphcp.runtime.capture.buckets import BucketSet

#: where a blocking upload is harmless: the batch check reads its all-gathered fingerprint
#: on the host right after (a synchronous collective by design)
SYNCHRONOUS = {"_check_consistency"}


class DirectUploads(TorchFunctionMode):
    """Records the calls that would upload host data on their own on a GPU: ``Tensor.to``
    with a device, ``Tensor.cuda``, and ``torch.tensor`` / ``as_tensor`` of host data
    with a device (on the CPU these run too, which is what makes them countable here)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = False
        if func is torch.Tensor.to:
            hit = kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])
        elif func is torch.Tensor.cuda:
            hit = True
        elif func in (torch.tensor, torch.as_tensor):
            hit = kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor)
        if hit:
            stack = traceback.extract_stack()[:-1]
            if not SYNCHRONOUS & {f.name for f in stack}:
                f = stack[-1]
                self.hits.append(f"{f.filename.rsplit('graphcp/', 1)[-1]}:{f.lineno} {f.name}")
        return func(*args, **kwargs)


def uploads_of(engine: PrefillEngine, batch: list[Request], **kw) -> tuple[dict[str, int], list[str], str]:
    """One prefill: its uploads per asking function, the direct uploads, the path it ran."""
    rec, direct = UploadRecorder(), DirectUploads()
    with staging.uploads_through(rec), direct:
        out = engine.prefill(batch, **kw)
    for h in out.handles:
        engine.release(h)
    return rec.sites(), direct.hits, out.info.path


@pytest.fixture(scope="module")
def dense(hf_model_dir):
    return hf_model_dir("qwen3")


@pytest.mark.parametrize("graph,attention", [("off", "triton"), ("breakable", "triton"), ("breakable", "torch")])
def test_a_forward_uploads_each_array_once_and_never_blocks(dense, graph, attention):
    """Eager: the rows (ids, positions, slots: one array), the attention metadata (one
    packed buffer; the triton kernel reads it), the last rows' indices; a replay: the
    metadata its breaks read and the last rows' indices (its static inputs are staged,
    tests/test_static_buffers.py); with every token's logits, the gather order too. The
    torch reference uploads its page lists, one array for all."""
    eng = PrefillEngine(dense, RuntimeConfig(kv_tokens=1024, graph=graph, attention=attention), None,
                        BucketSet((32, 64), padding_factor=64.0))
    rng = np.random.default_rng(1)
    prefix = eng.prefill([Request(rng.integers(0, 512, 21))]).handles[0]
    batch = [Request(rng.integers(0, 512, 9), prefix), Request(rng.integers(0, 512, 5))]
    sites, direct, path = uploads_of(eng, batch, all_logits=True)
    assert path == ("eager" if graph == "off" else "graph")
    assert direct == [], direct
    meta = {"_device_tensors": 1} if attention == "triton" else {"_runs": 1}
    rows = {"eager": 1} if graph == "off" else {}
    assert sites == {**rows, **meta, "last_logits": 1, "in_batch_order": 1}, sites


def test_dsv4_reference_uploads_per_forward_not_per_block():
    """DeepSeek V4's reference attention (in the break, every layer): the row groups'
    pages, positions and scored rows in one upload a forward, the pooling plan one a
    compressed kind that closes entries; a 900-token request (four 256-row blocks, a
    scored CSA row range) uploads no more than a 40-token one beyond that plan. The
    expert-parallel MoE uploads its routing (two arrays a layer)."""
    eng = PrefillEngine(ensure_preset("default-v4"), RuntimeConfig(kv_tokens=2048, page_size=8))
    rng = np.random.default_rng(2)
    small, direct_small, _ = uploads_of(eng, [Request(rng.integers(0, 8000, 40))])
    large, direct_large, _ = uploads_of(eng, [Request(rng.integers(0, 8000, 900))])
    assert direct_small == direct_large == [], (direct_small, direct_large)
    assert small["_upload_groups"] == large["_upload_groups"] == 1
    assert (small["_pool_plan"], large["_pool_plan"]) == (1, 2)  # CSA's entries close at 40 tokens, HCA's at 128
    layers = eng.cfg.num_layers
    for sites in (small, large):
        assert sites["ep_forward"] == 2 * layers and sites["eager"] == sites["last_logits"] == 1, sites
    assert {k: v for k, v in small.items() if k != "_pool_plan"} == {k: v for k, v in large.items()
                                                                     if k != "_pool_plan"}


def test_pinned_uploads_queue_a_copy_from_pinned_memory(monkeypatch):
    """On CUDA an upload is a pinned block of torch's caching host allocator holding a copy
    of the array, queued with non_blocking=True (the allocator keeps the block until the copy
    ran, so the array may be rewritten at once); on a CPU the array itself. CUDA's calls are
    recorded here, where this torch has none."""
    calls = []
    real_empty = torch.empty

    def empty(*shape, dtype=None, pin_memory=False):
        calls.append(("empty", pin_memory))
        return real_empty(*shape, dtype=dtype)

    def to(self, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking))
        return self.clone()

    host = np.arange(6, dtype=np.int32).reshape(2, 3)
    on_cpu = staging.PinnedUploads().to_device(host, torch.device("cpu"))
    assert on_cpu.data_ptr() == host.ctypes.data  # no copy on a CPU
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    got = staging.PinnedUploads().to_device(host, torch.device("cuda"))
    host[:] = -1  # rewritten at once: the upload holds its own copy
    assert calls == [("empty", True), ("to", "cuda", True)]
    assert got.tolist() == [[0, 1, 2], [3, 4, 5]]


# ---- a decode step: no blocking upload, no read of the device (issue 50) -----------------
#: functions that read a tensor's values on the host (on a GPU: a copy and a stream sync)
HOST_READS = (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__array__,
              torch.equal)
#: where a read is of host memory on a GPU too: the next tokens' pinned buffer, read once
#: the watchdog saw the step's copy run; the step's fingerprint, all-gathered over gloo
HOST_MEMORY_SITES = {"_next_tokens": "next tokens", "check_same_step": "fingerprint"}


class DeviceReads(TorchFunctionMode):
    """Reads of tensor values on the host, on a fake device: every tensor is the device's
    but the host buffers the test registers (``host``: storage pointers; the static
    buffers' staging) and those read at :data:`HOST_MEMORY_SITES`, counted apart. Each
    hit: (site, shape of the tensor read)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host, self.hits, self.host_memory = host, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage().data_ptr() not in self.host:
            stack = [f for f in traceback.extract_stack() if "/graphcp/" in f.filename]
            known = [HOST_MEMORY_SITES[n] for n in HOST_MEMORY_SITES if n in {f.name for f in stack}]
            f = stack[-1]
            site = known[0] if known else f"{f.filename.rsplit('graphcp/', 1)[-1]}:{f.lineno} {f.name}"
            (self.host_memory if known else self.hits).append((site, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def _decode_steps(group, folder: str, graph: str, logits: bool) -> list[dict]:
    """Three decode steps of three requests (the first captures and checks its bucket):
    per step, its path, staged and direct uploads, device reads and host-memory reads."""
    from graphcp.runtime.capture import static_buffers

    host: set[int] = set()

    def registered_host(n, dtype):
        t = torch.zeros(n, dtype=dtype)
        host.add(t.untyped_storage().data_ptr())
        return t

    static_buffers._plain_host = registered_host  # (a launched rank's own process)
    rt = RuntimeConfig(kv_tokens=1024, graph=graph, page_size=16, kv_cache="sharded" if group.size > 1 else "replicated")
    eng = PrefillEngine(folder, rt, group)
    handles = eng.prefill([Request(np.arange(n) % 500 + 1) for n in (5, 33, 1)]).handles
    steps = []
    for j in range(3):
        rec, direct, reads = UploadRecorder(), DirectUploads(), DeviceReads(host)
        with staging.uploads_through(rec), reads, direct:
            out = eng.decode(handles, [7 + j, 8, 9], logits=logits)
        handles = out.handles
        steps.append(dict(path=out.info.path, staged=rec.sites(), direct=direct.hits, reads=reads.hits,
                          host_memory=reads.host_memory, vocab=eng.cfg.vocab_size))
    return steps


@pytest.mark.parametrize("cp", [1, 2])
def test_a_decode_step_on_its_graph_neither_uploads_nor_reads_the_device(dense, cp):
    """After its bucket's first replay (capture and self-check), a graph step uploads only
    through its static buffers' pinned staging (no staged array, no direct upload) and
    reads nothing of the device but its next tokens, once, from the pinned download the
    watchdog waited for; at CP 2 its fingerprint goes over gloo (host memory). No
    ``[B, vocab]`` copy: logits were not asked for."""
    from graphcp.dist import CPGroup, launch

    ranks = launch(_decode_steps, 2, dense, "breakable", False) if cp == 2 else [
        _decode_steps(CPGroup(), dense, "breakable", False)]
    for steps in ranks:
        assert [s["path"] for s in steps] == ["graph"] * 3
        for s in steps[1:]:  # (the first: the capture and its self-check, which agree over the group)
            assert s["staged"] == {} and s["direct"] == [] and s["reads"] == [], s
            want = [("next tokens", (1, 3))] + ([("fingerprint", (3,))] * cp if cp > 1 else [])
            assert sorted(s["host_memory"]) == sorted(want), s


def test_an_eager_decode_step_stages_its_uploads_and_copies_logits_only_when_asked(dense):
    """Eager: the rows in one staged upload and the step's lengths and page table (what
    the decode kernel reads) in one, nothing direct, no device read but the next tokens;
    with ``logits=True`` the one ``[B, vocab]`` copy, and none without."""
    from graphcp.dist import CPGroup

    for logits in (False, True):
        for s in _decode_steps(CPGroup(), dense, "off", logits):
            assert s["path"] == "eager" and s["direct"] == [] and s["staged"] == {"eager": 1, "_device_tensors": 1}, s
            assert [(site.split(":")[0], shape) for site, shape in s["reads"]] == (
                [("runtime/decode/decoder.py", (3, s["vocab"]))] if logits else []), s
            assert s["host_memory"] == [("next tokens", (1, 3))], s


def _hybrid_uploads(group, folder, graph):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, graph=graph), group,
                        BucketSet((64, 256), padding_factor=64.0))
    if graph != "off":
        eng.capture()  # every bucket first: a capture's own uploads are not a forward's
    rng = np.random.default_rng(4)
    prefix = eng.prefill([Request(rng.integers(0, 512, 30))]).handles[0]
    return uploads_of(eng, [Request(rng.integers(0, 512, 9), prefix), Request(rng.integers(0, 512, 100))])


@pytest.mark.parametrize("cp,graph", [(1, "off"), (1, "breakable"), (2, "off")])
def test_the_hybrid_scan_uploads_once_a_forward(hf_model_dir, cp, graph):
    """A hybrid's linear layers (three of them here): the scan's plan and its kernels'
    varlen layouts in one packed upload a forward (``LinearScan._upload``), not one per
    array or per layer; nothing uploads on its own."""
    from graphcp.dist import launch

    sites, direct, path = launch(_hybrid_uploads, cp, hf_model_dir("qwen3_5_text"), graph)[0]
    assert path == ("eager" if graph == "off" else "graph")
    assert direct == [], direct
    assert sites.get("_upload") == 1, sites
