"""Ring pass-Q: the queries circulate, the KV stays where it is stored.

Rank ``r`` sends its query rows to rank ``r + 1`` and posts the receive of rank
``r - 1``'s, then attends its own rows to its own keys (step 0, causal). At step
``i`` it holds rank ``(r - i) mod C``'s rows: it posts forwarding them (and
receiving the next ones) before attending them to its own pool (non-causal,
masked by position through the plan's ``kv_len``), keeping the partial output and
LSE of every rank's rows. After the ring, one all-to-all returns each rank its
rows' partials (outputs in the model dtype and float32 LSEs, packed into one
byte buffer), and each rank merges its C partials by LSE
(:func:`graphcp.attention.ring.merge.merge_states`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionBackend
from graphcp.attention.ring.buffers import RingBuffers
from graphcp.attention.ring.merge import merge_states
from graphcp.attention.ring.plan import RingPlan
from graphcp.attention.ring.schedule import run_ring_schedule


def buffers(max_rows: int, total_rows: int, rows: int, cp_size: int, heads: int, dim: int,
            q_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every buffer pass-Q uses, name -> (shape, dtype): the two visiting-query buffers
    (``max_rows``: the most rows a rank has), every rank's partial outputs and LSEs
    (``total_rows``), and the all-to-all's send (the others' rows) and receive (this
    rank's ``rows`` from each other rank) of ``[output bytes | LSE bytes]`` rows. The
    run and the per-bucket reservation (:meth:`RingAttention.reserve`) both size them here."""
    width = heads * dim * q_dtype.itemsize + heads * 4
    f32, u8 = torch.float32, torch.uint8
    return {"q_stage0": ((max_rows, heads, dim), q_dtype), "q_stage1": ((max_rows, heads, dim), q_dtype),
            "parts_out": ((total_rows, heads, dim), q_dtype), "parts_lse": ((total_rows, heads), f32),
            "a2a_send": ((total_rows - rows, width), u8), "a2a_recv": (((cp_size - 1) * rows, width), u8)}


def run_pass_q(ring: RingPlan, group, backends: Sequence[AttentionBackend], kv_layer: torch.Tensor,
               bufs: RingBuffers, q: torch.Tensor, out: torch.Tensor) -> int:
    """Attend every rank's rows to this rank's keys, return the partials to their
    owners and merge this rank's; write ``out[:n]``. Returns the bytes received."""
    C, r = ring.cp_size, ring.rank
    rows = ring.rows
    n, (_, heads, dim) = rows[r], q.shape
    off = np.concatenate([[0], np.cumsum(rows)]).tolist()
    bs = {name: bufs.get(name, *spec) for name, spec in buffers(max(rows), off[-1], n, C, heads, dim, q.dtype).items()}
    qbuf = [bs["q_stage0"], bs["q_stage1"]]
    part, part_lse = bs["parts_out"], bs["parts_lse"]  # every rank's rows, rank-major

    def step(i: int, src: int) -> None:
        a, b = off[src], off[src + 1]
        queries = q if i == 0 else qbuf[i % 2]
        backends[i].forward(queries[: b - a], kv_layer, ring.steps[i], part[a:b], part_lse[a:b])

    ob = heads * dim * q.element_size()  # a row's output bytes (a query row's too)
    received = run_ring_schedule(group, rows, ob, q, qbuf, step)
    # every other rank's partials go home in one all-to-all: [output bytes | LSE bytes] per row
    send = bs["a2a_send"]
    for dst, (a, b) in zip((0, off[r]), ((0, off[r]), (off[r] + n, off[-1]))):
        send[dst : dst + b - a, :ob].view(q.dtype).copy_(part[a:b].reshape(b - a, heads * dim))
        send[dst : dst + b - a, ob:].view(torch.float32).copy_(part_lse[a:b])
    send_rows = [0 if k == r else rows[k] for k in range(C)]
    recv_rows = [0 if k == r else n for k in range(C)]
    recv = group.all_to_all_rows(send, send_rows, recv_rows, bs["a2a_recv"])
    received += recv.shape[0] * recv.shape[1]
    outs = [part[off[r] : off[r] + n]]
    lses = [part_lse[off[r] : off[r] + n]]
    for b in range(C - 1):
        block = recv[b * n : (b + 1) * n]
        outs.append(block[:, :ob].view(q.dtype).view(n, heads, dim))
        lses.append(block[:, ob:].view(torch.float32))
    merged, _ = merge_states(outs, lses)
    out[:n].copy_(merged)
    return received
