"""Paged, variable-length, bottom-right-causal flash attention in Triton.

Import this module only after deciding to use Triton: it imports ``triton`` at
the top, and ``triton.jit`` picks the interpreter or the compiler from
``TRITON_INTERPRET`` when the kernel is *defined*, i.e. at import time.

Scheduling. A program owns one KV head and a tile of query rows, with every
query head of that KV head's group packed into the tile (``BLOCK_M`` lanes =
``BLOCK_M / GROUP_P`` rows x ``GROUP_P`` heads, ``GROUP_P`` the group size rounded
up to a power of two), so each K/V tile is loaded once for the whole group
instead of once per query head. The grid is ``(cdiv(q_rows, BLOCK_M / GROUP_P),
num_kv_heads)`` where ``q_rows`` is the static row capacity of ``q``. Everything
else is read
on the device (``cu_seqlens_q``, ``kv_lens``, ``page_table``), so a captured
launch replays correctly for any plan that fits the same shapes. A row tile
may span several segments (short zigzag blocks, interleave's one-row
segments): the program finds the first and last segment of its rows by binary
search over ``cu_seqlens_q`` and attends them one after another, keeping one
online-softmax state per row (each row belongs to exactly one segment, so
rows of other segments are masked out and left unchanged). Tiles past
``cu_seqlens_q[-1]`` exit at once; rows past it (padding) are never stored.

Scores are kept in the log2 domain (``exp2``) and the LSE is converted to base
e before it is stored.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # loops over device-read ranges, Triton 3.6 too
    from graphcp.attention.kernels import interpreter_compat

    interpreter_compat.patch()

LOG2E = 1.4426950408889634
#: the row- and head-stride arguments the kernel multiplies in int64 (the compile check verifies it)
WIDE_STRIDES = ("stride_qm", "stride_qh", "stride_om", "stride_oh", "stride_lm", "stride_lh", "stride_kp", "stride_kt",
                "stride_kh", "stride_vp", "stride_vt", "stride_vh", "stride_pts")


# the metadata's count, pointers and page-table stride are not specialised (== 1, multiples of 16,
# 16-byte alignment): they change with the batch (packed metadata views, page-table width), and
# specialising on them would recompile per batch shape for loads that are not on the hot path
@triton.jit(do_not_specialize=["num_segments", "stride_pts", "CU_SEQLENS_Q", "KV_LENS", "PAGE_TABLE"])
def _paged_prefill_kernel(
    Q, K_CACHE, V_CACHE, OUT, LSE,
    CU_SEQLENS_Q, KV_LENS, PAGE_TABLE,
    num_segments,
    qk_scale_log2,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    # a tile packs ROWS query rows x GROUP_P query heads of one KV head into BLOCK_M
    # lanes (lane = row * GROUP_P + head in group), so each K/V tile is loaded once
    # for every query head that reads it
    ROWS: tl.constexpr = BLOCK_M // GROUP_P
    tile = tl.program_id(0)
    # head- and row-stride products in int64 (rows64, heads, kv_head, seg below): a stride
    # below 2**31 comes in as i32, and i32 x i32 wraps past 2**31 elements
    kv_head = tl.program_id(1).to(tl.int64)

    total_rows = tl.load(CU_SEQLENS_Q + num_segments)
    row0 = tile * ROWS
    if row0 < total_rows:
        row_last = tl.minimum(row0 + ROWS, total_rows) - 1
        seg_first = _find_segment(CU_SEQLENS_Q, num_segments, row0, SEARCH_STEPS)
        seg_last = _find_segment(CU_SEQLENS_Q, num_segments, row_last, SEARCH_STEPS)

        lanes = tl.arange(0, BLOCK_M)
        rows = row0 + lanes // GROUP_P
        g = lanes % GROUP_P
        heads = kv_head * GROUP + g  # int64 (kv_head is)
        dims = tl.arange(0, HEAD_DIM)
        lane_ok = (rows < total_rows) & (g < GROUP)
        rows64 = rows.to(tl.int64)
        q_ptrs = Q + rows64[:, None] * stride_qm + heads[:, None] * stride_qh + dims[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=lane_ok[:, None], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        for seg in range(seg_first, seg_last + 1):
            q_start = tl.load(CU_SEQLENS_Q + seg)
            q_end = tl.load(CU_SEQLENS_Q + seg + 1)
            kv_len = tl.load(KV_LENS + seg)
            q_len = q_end - q_start
            in_seg = (rows >= q_start) & (rows < q_end)
            if CAUSAL:
                # keys row `rows - q_start` may see: j <= rows - q_start + (kv_len - q_len)
                limit = rows - q_start + (kv_len - q_len)
                last_local = tl.minimum(row0 + ROWS, q_end) - 1 - q_start
                # empty segments inside the tile's range do no work
                kv_hi = tl.where(q_len > 0, tl.minimum(kv_len - q_len + last_local + 1, kv_len), 0)
            else:
                # every row sees all kv_len keys (0 keys: output 0, LSE -inf below)
                limit = rows * 0 + (kv_len - 1)
                kv_hi = tl.where(q_len > 0, kv_len, 0)
            pt_row = PAGE_TABLE + stride_pts.to(tl.int64) * seg  # seg: a Python int when interpreted
            for n0 in range(0, kv_hi, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_ok = cols < kv_hi
                page = tl.load(pt_row + (cols // PAGE_SIZE) * stride_ptp, mask=col_ok, other=0).to(tl.int64)
                slot = (cols % PAGE_SIZE).to(tl.int64)
                k_ptrs = (
                    K_CACHE + page[:, None] * stride_kp + slot[:, None] * stride_kt
                    + kv_head * stride_kh + dims[None, :] * stride_kd
                )
                v_ptrs = (
                    V_CACHE + page[:, None] * stride_vp + slot[:, None] * stride_vt
                    + kv_head * stride_vh + dims[None, :] * stride_vd
                )
                k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
                if UPCAST_DOT:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
                visible = in_seg[:, None] & col_ok[None, :] & (cols[None, :] <= limit[:, None])
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # rows with nothing visible yet keep m = -inf; subtract 0 instead
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - m_safe[:, None])
                alpha = tl.math.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = OUT + rows64[:, None] * stride_om + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=lane_ok[:, None])
        if HAS_LSE:
            lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # log2 -> ln: * ln 2
            tl.store(LSE + rows64 * stride_lm + heads * stride_lh, lse, mask=lane_ok)


@triton.jit
def _find_segment(CU_SEQLENS_Q, num_segments, row, SEARCH_STEPS: tl.constexpr):
    """Largest s in [0, num_segments) with cu_seqlens_q[s] <= row: the segment
    holding ``row`` (empty segments before it share its start and lose)."""
    lo = row * 0
    hi = lo + num_segments - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        start = tl.load(CU_SEQLENS_Q + mid)
        go_right = start <= row
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


def search_steps(num_segments: int) -> int:
    """Binary-search iterations that pin one of ``num_segments`` candidates, rounded
    up to a multiple of 4 (extra iterations keep the answer): the count is a
    compile-time constant, so batches of 1 to 16 segments share one compile."""
    bits = (max(num_segments, 1) - 1).bit_length()
    return 4 * max(1, -(-bits // 4))


def group_lanes(group: int) -> int:
    """Lanes one query row takes in a tile: the GQA group size rounded up to a power of two."""
    return 1 << (group - 1).bit_length()


def launch(
    q, k_cache, v_cache, out, lse, cu_seqlens_q, kv_lens, page_table,
    *, group: int, page_size: int, scale: float, block_m: int, block_n: int,
    upcast_dot: bool, num_warps: int, num_stages: int,
    k_strides: tuple[int, int, int, int], v_strides: tuple[int, int, int, int],
    causal: bool = True,
) -> None:
    """Launch over the static shapes of ``q``; ``k_strides``/``v_strides`` are
    (page, token, head, dim) strides so one kernel serves NHD and HND.
    ``block_m`` (lanes per tile) must be at least :func:`group_lanes` (group)."""
    rows, num_q_heads, head_dim = q.shape
    num_segments = kv_lens.shape[0]
    group_p = group_lanes(group)
    if block_m < group_p:
        raise ValueError(f"block_m={block_m} lanes cannot hold a GQA group of {group} heads ({group_p} lanes)")
    grid = (triton.cdiv(rows, block_m // group_p), num_q_heads // group)
    has_lse = lse is not None
    lse_arg = lse if has_lse else out  # never read when HAS_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1)) if has_lse else (0, 0)
    # fp32 operands: IEEE products, otherwise the GPU would round them to TF32
    precision = "ieee" if q.dtype.itemsize == 4 or upcast_dot else None
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, lse_arg,
        cu_seqlens_q, kv_lens, page_table,
        num_segments,
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        *k_strides,
        *v_strides,
        page_table.stride(0), page_table.stride(1),
        GROUP=group,
        GROUP_P=group_p,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SEARCH_STEPS=search_steps(num_segments),
        HAS_LSE=has_lse,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=precision,
        CAUSAL=causal,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def compiled_kernels() -> list | None:
    """The kernel's compiled variants so far (None under the interpreter, which
    compiles nothing); each carries what the driver reported (``n_regs``,
    ``n_spills``, ``metadata``)."""
    return compiled_variants(_paged_prefill_kernel)


def compiled_variants(kernel) -> list | None:
    """A ``triton.jit`` kernel's compiled variants so far (None when interpreted)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    out = []
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry  # (kernel cache, ...) in recent Triton
        if isinstance(cache, dict):
            out.extend(cache.values())
    return out
