"""Small helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in float64); ``b`` is the reference."""
    a = torch.as_tensor(a).detach().to(torch.float64)
    b = torch.as_tensor(b).detach().to(torch.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    ref = b.norm()
    if ref == 0:
        return float((a - b).norm())
    return float((a - b).norm() / ref)


def mesh_engine(group, folders: dict, buckets, parallel, family: str, dtype: str, layout: str, kv_cache: str,
                graph: str, moe: str, aux: tuple[int, ...]):
    """A PrefillEngine of a mesh test case (tests/test_attn_tp.py, test_attn_dp.py): a
    bfloat16 MoE family runs its all-experts twin (``folders[family + "-all"]``: top-8 of
    8, since a router near-tie flips an expert under bfloat16 rounding with top-k < E, as
    tests/test_moe_parity.py says); a full graph captures the Triton kernel."""
    from graphcp import PrefillEngine, RuntimeConfig

    rt = RuntimeConfig(dtype=dtype, layout=layout, kv_cache=kv_cache, graph=graph, moe=moe, kv_tokens=1024,
                       aux_hidden_layers=aux, attention="triton" if graph == "full" else "torch")
    return PrefillEngine(folders[twin_of(family, dtype)], rt, group, buckets, parallel)


def twin_of(family: str, dtype: str) -> str:
    """The folder key a mesh test runs ``family`` from in ``dtype`` (:func:`mesh_engine`)."""
    return family + "-all" if family == "qwen3_moe" and dtype == "bfloat16" else family


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a checkpoint folder (for tests that corrupt it)."""
    shutil.copytree(src, dst)
    return dst


def graph_then_eager(engine, toks, prefix, extends: int) -> dict:
    """The batch ``toks`` (request ``extends`` extending a cached ``prefix``) on the graph
    path, then eagerly: ``{"graph": PrefillOutput, "eager": PrefillOutput}`` (all logits;
    KV released)."""
    from graphcp import Request

    out = {}
    for path in ("graph", "eager"):
        h = engine.prefill([Request(prefix)]).handles[0]
        out[path] = engine.prefill([Request(t, h if j == extends else None) for j, t in enumerate(toks)],
                                   all_logits=True, force_eager=path == "eager")
        for x in out[path].handles:
            engine.release(x)
    return out


def send_export(group, folder, address: str, runtime, prefix, new, name: str):
    """One rank's part of a Mooncake send: prefill ``new`` after a cached ``prefix`` on
    ``folder`` with ``runtime``, send the request's KV as ``name`` to the receiver at
    ``address`` (graphcp.pd.sender), and return the export rank 0 gets (None elsewhere)."""
    from graphcp import PrefillEngine
    from graphcp.pd.sender import KVSender
    from graphcp.runtime.engine import prefill_after_prefixes

    eng = PrefillEngine(folder, runtime, group)
    h = prefill_after_prefixes(eng, [(prefix, new)]).handles[0]
    sender = KVSender(address, group.rank, group.size, timeout_s=60)
    sender.send(eng, [h], [name])
    sender.close()
    return eng.export_kv(h, dst=0)


def sigint_default() -> None:
    """``preexec_fn`` of a process a test interrupts: SIGINT back to its default whatever
    the test run was started with. ``nohup pytest ... &`` starts it ignored, a disposition
    every child inherits across ``exec`` (Python then installs no KeyboardInterrupt
    handler: the Ctrl-C the test sends does nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kv_cache(mode: str, layers: int, pages: int, page_size: int, heads: int, dim: int,
             dtype: torch.dtype = torch.float32, *, max_pages_per_seq: int | None = None, first_layer: int = 0,
             rank: int = 0, cp_size: int = 1, layout: str = "NHD"):
    """A dense model's cache of ``mode`` from the one factory (graphcp.kv.factory): ``layers``
    layers from ``first_layer`` of ``heads`` K/V heads of ``dim``, ``pages`` pages of ``page_size``."""
    from graphcp.kv.factory import make_cache
    from graphcp.kv.spec import KVHeads, PoolSpec

    pool = PoolSpec(range(first_layer, first_layer + layers), pages, page_size, dtype, "cpu", max_pages_per_seq,
                    rank, cp_size)
    return make_cache(mode, KVHeads(heads, dim, layout), pool)


def hf_greedy(model, prompts, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy generate of each prompt (numpy ids) alone: tokens [R, new],
    float32 logits [R, new, V] (an explicit mask: without one, generate masks prompt
    tokens equal to pad_token_id)."""
    toks, logits = [], []
    for p in prompts:
        with torch.inference_mode():
            g = model.generate(torch.from_numpy(p).view(1, -1), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=new, min_new_tokens=new, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        toks.append(g.sequences[0, len(p):])
        logits.append(torch.stack([x[0].float() for x in g.logits]))
    return torch.stack(toks), torch.stack(logits)
