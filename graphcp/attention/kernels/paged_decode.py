"""Paged decode attention in Triton: one query row a request, split over its keys.

Import this module only after deciding to use Triton (as ``paged_prefill``: ``triton.jit``
picks the interpreter or the compiler from ``TRITON_INTERPRET`` when it is imported).

Scheduling (flash-decoding). A program owns one request (row), one KV head and one split
of the keys: every query head of that KV head's group is a lane of its tile
(``GROUP_P`` lanes, the group rounded up to a power of two, at least 16 for ``tl.dot``),
so each K/V tile is loaded once for the whole group. Split ``s`` covers the keys
``[s * chunk, min((s + 1) * chunk, kv_len))`` of its row, read page by page from the
row's own page-table entries: a row reads its own pages and nothing past its length
(a split past it does no work). With one split the program writes the output and the
LSE itself; with several, each writes a float32 partial (output and base-2 LSE) and
:func:`_merge_splits_kernel` merges them per (row, head).

The grid is ``(rows, kv_heads, splits)``, every size a static shape (``q``'s rows, the
page table's width): the lengths and pages are read on the device, so a captured launch
replays for any step its bucket holds. No size is a constexpr, so steps of any batch and
width share four compiled variants (with or without LSE, one split or several) and the
merge's two. A row with no key (a rank that holds none of a request, a padding row) gets
output 0 and LSE -inf.

Scores are in the log2 domain (``exp2``); the stored LSE is natural-log.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # loops over device-read ranges, Triton 3.6 too
    from graphcp.attention.kernels import interpreter_compat

    interpreter_compat.patch()

LOG2E = 1.4426950408889634
#: the least lanes a tile has (tl.dot's smallest M)
MIN_LANES = 16
#: programs a launch aims for (two waves of an H100's 132 SMs), and the fewest keys a split takes
#: (MAX_SPLITS: a power of two, the merge's lanes)
TARGET_PROGRAMS, MIN_SPLIT_KEYS, MAX_SPLITS = 264, 256, 64
#: the stride arguments multiplied in int64
WIDE_STRIDES = ("stride_qm", "stride_qh", "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_kp",
                "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh", "stride_pts")


@triton.jit(do_not_specialize=["chunk", "stride_pts", "stride_lm", "stride_lh", "KV_LENS", "PAGE_TABLE"])
def _paged_decode_kernel(
    Q, K_CACHE, V_CACHE, OUT, LSE,
    KV_LENS, PAGE_TABLE,
    qk_scale_log2, chunk,
    stride_qm, stride_qh, stride_qd,
    stride_om, stride_oh, stride_od,
    stride_lm, stride_lh,
    stride_kp, stride_kt, stride_kh, stride_kd,
    stride_vp, stride_vt, stride_vh, stride_vd,
    stride_pts, stride_ptp,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_LSE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # OUT/LSE: the output and LSE (one split), or (PARTIAL: several) the float32 partials
    # [rows, heads, splits, D] and [rows, heads, splits] (base 2) the merge reads (the strides
    # then step a head's splits). The split count is no constexpr: an eager step's table width
    # varies, and each value would compile a variant.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    kv_len = tl.load(KV_LENS + row)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    lanes = tl.arange(0, GROUP_P)
    lane_ok = lanes < GROUP
    heads = kv_head * GROUP + lanes
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row * stride_qm + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=lane_ok[:, None], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], dtype=tl.float32)
    pt_row = PAGE_TABLE + stride_pts.to(tl.int64) * row
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        page = tl.load(pt_row + (cols // PAGE_SIZE) * stride_ptp, mask=col_ok, other=0).to(tl.int64)
        slot = (cols % PAGE_SIZE).to(tl.int64)
        k = tl.load(K_CACHE + page[:, None] * stride_kp + slot[:, None] * stride_kt + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
        v = tl.load(V_CACHE + page[:, None] * stride_vp + slot[:, None] * stride_vt + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: subtract 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]  # 0 where no key was seen
    lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    if not PARTIAL:
        tl.store(OUT + row * stride_om + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(OUT.dtype.element_ty), mask=lane_ok[:, None])
        if HAS_LSE:
            tl.store(LSE + row * stride_lm + heads * stride_lh, lse2 * 0.6931471805599453, mask=lane_ok)
    else:
        part = row * stride_om + heads * stride_oh + split * HEAD_DIM
        tl.store(OUT + part[:, None] + dims[None, :] * stride_od, o, mask=lane_ok[:, None])
        tl.store(LSE + row * stride_lm + heads * stride_lh + split, lse2, mask=lane_ok)


@triton.jit(do_not_specialize=["stride_pm", "stride_ph", "stride_lpm", "stride_lph", "splits"])
def _merge_splits_kernel(
    O_PART, L_PART, OUT, LSE,
    stride_pm, stride_ph, stride_lpm, stride_lph,
    stride_om, stride_oh, stride_od,
    stride_lm, stride_lh, splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """One (row, head): its ``splits`` partials merged by their base-2 LSEs (``SPLITS_P``:
    :data:`MAX_SPLITS` lanes, whatever the count: one variant)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_P)
    ok = s < splits
    dims = tl.arange(0, HEAD_DIM)
    lse2 = tl.load(L_PART + row * stride_lpm + head * stride_lph + s, mask=ok, other=float("-inf"))
    top = tl.max(lse2, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.math.exp2(lse2 - top_safe)  # 0 for a split that saw no key
    total = tl.sum(w, 0)
    o = tl.load(O_PART + row * stride_pm + head * stride_ph + s[:, None] * HEAD_DIM + dims[None, :],
                mask=ok[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + row * stride_om + head * stride_oh + dims * stride_od, merged.to(OUT.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(total > 0.0, (top_safe + tl.math.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + row * stride_lm + head * stride_lh, lse)



def group_lanes(group: int) -> int:
    """Lanes of a tile: the GQA group rounded up to a power of two, at least :data:`MIN_LANES`."""
    return max(MIN_LANES, 1 << (group - 1).bit_length())


def split_plan(rows: int, kv_heads: int, max_keys: int, block_n: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, keys a split) for ``rows`` requests of at most ``max_keys`` keys (the page
    table's width in tokens, a static shape): enough splits that rows x KV heads x splits
    reach :data:`TARGET_PROGRAMS`, each of at least :data:`MIN_SPLIT_KEYS` keys (``splits``:
    a fixed count instead); a split's keys a multiple of ``block_n``."""
    if splits is None:
        want = -(-TARGET_PROGRAMS // max(1, rows * kv_heads))
        splits = max(1, min(want, -(-max_keys // MIN_SPLIT_KEYS), MAX_SPLITS))
    chunk = -(-max(1, -(-max_keys // splits)) // block_n) * block_n
    return max(1, -(-max_keys // chunk)), chunk


def launch(q, k_cache, v_cache, out, lse, kv_lens, page_table, *, group: int, page_size: int, scale: float,
           block_n: int, upcast_dot: bool, num_warps: int, num_stages: int,
           k_strides: tuple[int, int, int, int], v_strides: tuple[int, int, int, int],
           splits: int | None = None) -> None:
    """Attend every row of ``q`` [rows, Hq, D] (one a request) over its ``kv_lens`` keys in
    its ``page_table`` row; ``out`` [rows, Hq, D], ``lse`` [rows, Hq] float32 or None.
    ``k_strides``/``v_strides``: (page, token, head, dim), so NHD and HND caches alike."""
    rows, num_q_heads, head_dim = q.shape
    kv_heads = num_q_heads // group
    n_splits, chunk = split_plan(rows, kv_heads, page_table.shape[1] * page_size, block_n, splits)
    precision = "ieee" if q.dtype.itemsize == 4 or upcast_dot else None
    consts = dict(GROUP=group, GROUP_P=group_lanes(group), PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_N=block_n,
                  PARTIAL=n_splits > 1, HAS_LSE=lse is not None, UPCAST_DOT=upcast_dot, DOT_PRECISION=precision,
                  num_warps=num_warps, num_stages=num_stages)
    grid = (rows, kv_heads, n_splits)
    tables = (kv_lens, page_table, scale * LOG2E, chunk)
    tail = (*k_strides, *v_strides, page_table.stride(0), page_table.stride(1))
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    if n_splits == 1:
        lse_arg = lse if lse is not None else out  # never written without HAS_LSE
        lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        _paged_decode_kernel[grid](q, k_cache, v_cache, out, lse_arg, *tables, *q_strides,
                                   out.stride(0), out.stride(1), out.stride(2), *lse_strides, *tail, **consts)
        return
    o_part = torch.empty(rows, num_q_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
    l_part = torch.empty(rows, num_q_heads, n_splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[grid](q, k_cache, v_cache, o_part, l_part, *tables, *q_strides,
                               o_part.stride(0), o_part.stride(1), 1, l_part.stride(0), l_part.stride(1), *tail,
                               **consts)
    lse_arg = lse if lse is not None else out
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    _merge_splits_kernel[(rows, num_q_heads)](
        o_part, l_part, out, lse_arg, o_part.stride(0), o_part.stride(1), l_part.stride(0), l_part.stride(1),
        out.stride(0), out.stride(1), out.stride(2), *lse_strides, n_splits, HEAD_DIM=head_dim,
        SPLITS_P=MAX_SPLITS, HAS_LSE=lse is not None, num_warps=num_warps)
