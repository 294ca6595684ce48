"""Sparse latent-attention prefill in Triton: each query row over its selected tokens only,
gathered from the paged latent cache (the weight-absorbed form of the flash kernels' sparse
prefill).

Import this module only after deciding to use Triton: ``triton.jit`` picks the
interpreter or the compiler from ``TRITON_INTERPRET`` when the kernel is defined.

The absorbed form. Latent attention's keys and values are the latent ``c_t`` (``kv_lora_rank``
values) decompressed per head by ``kv_b_proj`` (``k_nope[h] = W_UK[h] c_t``,
``v[h] = W_UV[h] c_t``) plus a rope key ``r_t`` shared by every head. So with
``q_lat[h] = q_nope[h] @ W_UK[h]`` (done before the kernel)

    score(h, t) = (q_lat[h] . c_t + q_rope[h] . r_t) * softmax_scale
    out_lat[h]  = sum_t softmax_t(score(h, t)) c_t

and ``out[h] = out_lat[h] @ W_UV[h]^T`` (after the kernel): the kernel reads the
cached rows ``[c_t | r_t]`` as they are, never a decompressed per-head K/V.

Scheduling. A program owns one query row and a tile of ``BLOCK_H`` heads (all heads of
a row read the same gathered tokens: each gathered tile is loaded once for the heads of
the tile, as the flash kernels do). It walks the row's selected positions (``SELECTED [rows,
k]``, ascending, -1 padding at the end; ``COUNTS [rows]`` the valid ones) in tiles of
``BLOCK_N``: each position goes through the request's page table row (``ROW_TABLE``
names it) to its page and slot, the ``[BLOCK_N, kv_lora + rope]`` rows are gathered,
then QK, an online softmax (log2 domain, float32) and PV with float32 accumulation. A
row with no selected token (padding) writes zeros. Latent and rope widths need not be
powers of two: they are padded to one and masked.
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
WIDE_STRIDES = ("stride_lm", "stride_lh", "stride_rm", "stride_rh", "stride_cp", "stride_ct", "stride_om", "stride_oh",
                "stride_sm", "stride_ptr")


# the metadata pointers and the page-table stride change with the batch: not specialised
@triton.jit(do_not_specialize=["stride_ptr", "SELECTED", "COUNTS", "ROW_TABLE", "PAGE_TABLE"])
def _sparse_latent_kernel(
    Q_LAT, Q_ROPE, CACHE, OUT,
    SELECTED, COUNTS, ROW_TABLE, PAGE_TABLE,
    num_heads,
    qk_scale_log2,
    stride_lm, stride_lh, stride_ld,
    stride_rm, stride_rh, stride_rd,
    stride_cp, stride_ct, stride_cd,
    stride_om, stride_oh, stride_od,
    stride_sm, stride_sk,
    stride_ptr, stride_ptp,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # every row- and head-stride product in int64: a stride below 2**31 comes in as i32, and
    # i32 x i32 wraps (a head stride of rows x kv_lora passes 2**31 at ~33K rows x 128 heads).
    # The tile's first head times the stride is a scalar, its lanes a [BLOCK_H, 1] int64 vector
    # (an int64 heads vector kept live to the store made the fp32 sm_90a variant spill)
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * BLOCK_H
    hl = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    h_ok = (h0 + hl) < num_heads
    d = tl.arange(0, LORA_P)
    d_ok = d < KV_LORA
    r = tl.arange(0, ROPE_P)
    r_ok = r < ROPE

    ql = tl.load(Q_LAT + row * stride_lm + (h0 + hl) * stride_lh + d[None, :] * stride_ld,
                 mask=h_ok & d_ok[None, :], other=0.0)
    qr = tl.load(Q_ROPE + row * stride_rm + (h0 + hl) * stride_rh + r[None, :] * stride_rd,
                 mask=h_ok & r_ok[None, :], other=0.0)
    if UPCAST_DOT:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_P], dtype=tl.float32)

    count = tl.load(COUNTS + row)
    table = PAGE_TABLE + tl.load(ROW_TABLE + row).to(tl.int64) * stride_ptr
    for n0 in range(0, count, BLOCK_N):
        k = n0 + tl.arange(0, BLOCK_N)
        ok = k < count
        pos = tl.load(SELECTED + row * stride_sm + k * stride_sk, mask=ok, other=-1)
        ok = ok & (pos >= 0)
        pos = tl.where(ok, pos, 0)
        page = tl.load(table + (pos // PAGE_SIZE) * stride_ptp, mask=ok, other=0).to(tl.int64)
        tok = CACHE + page * stride_cp + (pos % PAGE_SIZE).to(tl.int64) * stride_ct  # [BLOCK_N] row addresses
        lat = tl.load(tok[:, None] + d[None, :] * stride_cd, mask=ok[:, None] & d_ok[None, :], other=0.0)
        rope = tl.load(tok[:, None] + (KV_LORA + r)[None, :] * stride_cd, mask=ok[:, None] & r_ok[None, :],
                       other=0.0)
        if UPCAST_DOT:
            lat = lat.to(tl.float32)
            rope = rope.to(tl.float32)
        s = tl.dot(ql, tl.trans(lat), input_precision=DOT_PRECISION)
        s += tl.dot(qr, tl.trans(rope), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing seen yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(OUT + row * stride_om + (h0 + hl) * stride_oh + d[None, :] * stride_od, o.to(OUT.dtype.element_ty),
             mask=h_ok & d_ok[None, :])


def padded(n: int) -> int:
    """The power of two >= max(n, 16) a width is padded to (``tl.dot`` needs >= 16)."""
    return max(16, 1 << (n - 1).bit_length())


def launch(q_lat, q_rope, cache, out, selected, counts, row_table, page_table, *, page_size: int, scale: float,
           block_h: int, block_n: int, upcast_dot: bool, num_warps: int, num_stages: int) -> None:
    """``q_lat [rows, H, kv_lora]``, ``q_rope [rows, H, rope]``, ``cache [pages, page_size,
    kv_lora + rope]`` (one layer), ``out [rows, H, kv_lora]``, ``selected [rows, k]`` and
    ``counts [rows]`` (int32), ``row_table [rows]`` (int32: the row of ``page_table`` each
    query row reads), ``page_table [requests, max_pages]`` (int32)."""
    rows, heads, kv_lora = q_lat.shape
    rope = q_rope.shape[2]
    grid = (rows, triton.cdiv(heads, block_h))
    # fp32 operands: IEEE products, otherwise the GPU would round them to TF32
    precision = "ieee" if q_lat.dtype.itemsize == 4 or upcast_dot else None
    _sparse_latent_kernel[grid](
        q_lat, q_rope, cache, out,
        selected, counts, row_table, page_table,
        heads,
        scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        selected.stride(0), selected.stride(1),
        page_table.stride(0), page_table.stride(1),
        KV_LORA=kv_lora, ROPE=rope, LORA_P=padded(kv_lora), ROPE_P=padded(rope), PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_N=block_n, UPCAST_DOT=upcast_dot, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )


def kernel():
    """The jitted kernel (the compile-only check builds it for CUDA targets)."""
    return _sparse_latent_kernel
