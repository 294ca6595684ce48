"""A mixture-of-experts layer (``tp`` layout: router, sort by expert, the grouped expert
matmuls ``torch._grouped_mm``, combine) captured once and replayed with inputs whose
routing differs at every replay, against the same layer run eagerly, bitwise, and the
plain per-expert loop (``reference_moe``). PyTorch issue 169970 reports an illegal memory
access at replay of a captured ``_grouped_mm`` on H100/H200 (torch >= 2.9); graphcp keeps
the ``tp`` layout's experts out of CUDA graphs (in the attention break) until this part passes on a GPU
(``graphcp.model.moe.experts.GROUPED_MM_GRAPHS_VALIDATED``; docs/moe.md). The ``cuda``
graph backend on a GPU (bfloat16, the sync-free kernel), ``trace`` in a dry run.
"""

from __future__ import annotations

import torch

from graphcp.dist import CPGroup
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import dtype_rows, fail, free_device_memory, log, sync
from graphcp.gpucheck.settings import Settings
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe.experts import reference_moe
from graphcp.model.moe_config import MoeConfig
from graphcp.runtime.capture.graphs import make_graph_backend

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _block(st: Settings, dtype: torch.dtype, dev: torch.device, g: torch.Generator) -> SparseMoeBlock:
    _, hidden, experts, top_k, inter = st.moe_shape
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=True, layers=(0,))
    block = SparseMoeBlock(moe, hidden, "tp", 0, 1, dtype).to(dev)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=dev) * p.shape[-1] ** -0.5)
    return block


def check_moe_graph(st: Settings, budget: Budget) -> list[dict]:
    """One record per dtype: replays bitwise equal to eager, routing changed, error vs the loop."""
    dev = torch.device(st.device)
    rows, hidden, experts, top_k, inter = st.moe_shape
    out: list[dict] = []
    base = {"rows": rows, "hidden": hidden, "experts": experts, "top_k": top_k, "intermediate": inter,
            "graph_backend": st.graph_backend}
    for i, name, rec in dtype_rows(out, st.moe_dtypes, base, budget):
        dtype = getattr(torch, name)
        try:
            g = torch.Generator(device=dev).manual_seed(st.seed + 100 + i)
            block, group = _block(st, dtype, dev, g), CPGroup()
            x_static = torch.randn(rows, hidden, generator=g, device=dev).to(dtype)
            y_static = torch.empty_like(x_static)
            backend = make_graph_backend(st.graph_backend, dev)
            seg = backend.new_segment()
            with torch.inference_mode(), backend.capture_stream():
                block(x_static, group)  # warm-up on the capture stream
                seg.begin()
                y_static.copy_(block(x_static, group))
                seg.end()
            backend.synchronize()
            diffs, errs, routings = [], [], []
            with torch.inference_mode():
                for _ in range(st.moe_replays):
                    x = torch.randn(rows, hidden, generator=g, device=dev).to(dtype)
                    x_static.copy_(x)
                    seg.replay()
                    sync(dev)
                    eager = block(x, group)
                    ids, w = block.router(x)
                    routings.append(ids.cpu())
                    want = reference_moe(x.float(), ids, w.float(), block.experts.gate_up.float(),
                                         block.experts.down.float())
                    diffs.append(float((y_static.float() - eager.float()).abs().max()))
                    errs.append(float((y_static.float() - want).norm() / want.norm().clamp(min=1e-30)))
            changed = all(not torch.equal(a, b) for a, b in zip(routings, routings[1:]))
            ok = max(diffs) == 0.0 and max(errs) <= TOL[name] and changed
            rec.update(status="pass" if ok else "fail", replays=st.moe_replays, bitwise_equal=max(diffs) == 0.0,
                       max_abs_diff_vs_eager=max(diffs), max_rel_err_vs_loop=max(errs), tol=TOL[name],
                       routing_changed=changed)
            if not changed:
                rec["error"] = "the routing did not change between replays"
            log(f"moe graph {name} ({st.graph_backend}): {st.moe_replays} replays, max |replay - eager| "
                f"{max(diffs):.3g}, rel err vs loop {max(errs):.3g}: {rec['status']}")
        except Exception as e:  # noqa: BLE001 - recorded (an illegal access ends the CUDA context: the last part)
            fail(rec, f"moe graph {name}", e)
        finally:
            free_device_memory(dev)
    return out
