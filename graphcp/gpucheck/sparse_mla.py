"""The sparse MLA Triton kernel (DSA models) against its torch form at a row count past
the old int32 offsets: DeepSeek V3.2's 128 heads x 512 latent over 34,000 query rows is
2.2e9 ``q_lat`` elements, so a row or head offset computed in 32 bits would wrap (wrong
rows or an illegal access; issue 25). A dry run checks the flow at tiny sizes in the
interpreter.

Random latent cache on pages in shuffled order, every row selecting ``topk`` ascending
positions (some rows fewer, -1 padded, one none); the kernel runs over all rows, and the
first and last rows (``sparse_checked_rows`` in all, the largest offsets among them) are
compared with the absorbed attention computed in float32 from the same inputs:
``softmax((q_lat . c_t + q_rope . r_t) * scale) @ c_t`` over each row's selected tokens.
"""

from __future__ import annotations

import time

import torch

from graphcp.attention.backends.triton import interpreting
from graphcp.attention.kernels.sparse_latent_configs import sparse_tile_config
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import dtype_rows, fail, free_device_memory, log, skip, sync
from graphcp.gpucheck.settings import Settings

TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _inputs(st: Settings, dtype: torch.dtype, dev: torch.device, g: torch.Generator) -> dict:
    rows, heads, lora, rope = st.sparse_shape
    page, k, tokens = st.page_size, st.sparse_topk, st.sparse_tokens
    pages = -(-tokens // page)
    cache = torch.randn(pages + 1, page, lora + rope, generator=g, device=dev).to(dtype)
    page_table = (torch.randperm(pages, generator=g, device=dev) + 1).to(torch.int32).unsqueeze(0)
    # k distinct ascending positions a row; row r keeps 1 + r % k of them (row 0: none), -1 after
    scores = torch.rand(rows, tokens, generator=g, device=dev)
    selected = scores.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    keep = torch.arange(rows, device=dev) % (k + 1)
    selected = torch.where(torch.arange(k, device=dev)[None, :] < keep[:, None], selected, -1)
    return dict(
        q_lat=torch.randn(rows, heads, lora, generator=g, device=dev).to(dtype),
        q_rope=torch.randn(rows, heads, rope, generator=g, device=dev).to(dtype),
        cache=cache, selected=selected, counts=(selected >= 0).sum(1, dtype=torch.int32),
        row_table=torch.zeros(rows, dtype=torch.int32, device=dev), page_table=page_table,
    )


def reference_rows(x: dict, rows: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """float32 ``[len(rows), heads, kv_lora]``: the absorbed sparse attention of ``rows``."""
    lora = x["q_lat"].shape[2]
    sel = x["selected"][rows].long()  # [R, k]
    ok = sel >= 0
    pos = sel.clamp(min=0)
    page = x["page_table"][0].long()[pos // page_size]
    tok = x["cache"][page, pos % page_size].float()  # [R, k, lora + rope]
    lat, rp = tok[..., :lora], tok[..., lora:]
    s = (torch.einsum("rhd,rkd->rhk", x["q_lat"][rows].float(), lat)
         + torch.einsum("rhd,rkd->rhk", x["q_rope"][rows].float(), rp)) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with nothing selected: zeros
    return torch.einsum("rhk,rkd->rhd", p, lat)


def check_sparse_mla(st: Settings, budget: Budget, available: list[str]) -> list[dict]:
    """One record per dtype: the largest relative error of the checked rows, pass/fail."""
    out: list[dict] = []
    rows, heads, lora, rope = st.sparse_shape
    base = {"rows": rows, "heads": heads, "kv_lora_rank": lora, "rope_dim": rope, "topk": st.sparse_topk,
            "q_lat_elements": rows * heads * lora, "past_int32": rows * heads * lora >= 2**31}
    if "triton" not in available:
        return [skip({**base, "dtype": d}, "the triton backend is not available") for d in st.sparse_dtypes]
    from graphcp.attention.kernels import sparse_latent as kernel

    dev = torch.device(st.device)
    scale = (lora + rope) ** -0.5
    for i, name, rec in dtype_rows(out, st.sparse_dtypes, base, budget):
        dtype = getattr(torch, name)
        try:
            x = _inputs(st, dtype, dev, torch.Generator(device=dev).manual_seed(st.seed + i))
            cfg = sparse_tile_config(lora, dtype)
            res = torch.empty_like(x["q_lat"])
            t0 = time.perf_counter()
            kernel.launch(x["q_lat"], x["q_rope"], x["cache"], res, x["selected"], x["counts"], x["row_table"],
                          x["page_table"], page_size=st.page_size, scale=scale, block_h=cfg.block_h,
                          block_n=cfg.block_n, upcast_dot=interpreting() and dtype != torch.float32,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            sync(dev)
            ms = 1e3 * (time.perf_counter() - t0)
            half = st.sparse_checked_rows // 2
            idx = torch.cat([torch.arange(min(half, rows)), torch.arange(max(rows - half, half), rows)]).to(dev)
            want = reference_rows(x, idx, st.page_size, scale)
            got = res[idx].float()
            err = float((got - want).norm() / want.norm().clamp(min=1e-30))
            rec.update(status="pass" if err <= TOL[name] else "fail", checked_rows=int(idx.numel()),
                       last_row_checked=int(idx[-1]), max_rel_err=err, tol=TOL[name], kernel_ms=round(ms, 2),
                       empty_rows_zero=bool(got[(x["counts"][idx] == 0)].eq(0).all()))
            if not rec["empty_rows_zero"]:
                rec.update(status="fail", error="a row with nothing selected is not zero")
            log(f"sparse MLA {name} {rows} rows x {heads} heads x {lora}: rel err {err:.3g} "
                f"(tol {TOL[name]}), {ms:.0f} ms: {rec['status']}")
        except Exception as e:  # noqa: BLE001 - recorded, the next dtype runs
            fail(rec, f"sparse MLA {name}", e)
        finally:
            x = res = None
            free_device_memory(dev)
    return out
