"""What a one-GPU machine cannot check: every multi-rank path (NCCL needs one GPU a rank,
graphcp/dist.py ``check_devices``), each with the command that checks it on a machine with
that many GPUs. ``graphcp run`` captures, replays and compares with the eager forward
(the same bucket bit for bit, the unpadded forward within graphcp.jobs.tolerance) and
exits 1 on a difference; ``graphcp pd-demo`` checks the hand-off's logits."""

from __future__ import annotations

#: (what, GPUs, command), in the report and docs/gpu_check.md
MULTI_GPU: tuple[tuple[str, int, str], ...] = (
    ("CP 2: the replicated cache's all-gather inside the captured body (nccl)", 2,
     "graphcp run --device cuda --cp 2 --attention triton"),
    ("CP 2, a full graph: the all-gather and the Triton kernel captured together", 2,
     "graphcp run --device cuda --cp 2 --attention triton --graph full"),
    ("CP 2, the sharded cache's pass-KV / pass-Q rings (nccl point-to-point)", 2,
     "graphcp run --device cuda --cp 2 --attention triton --kv-cache sharded"),
    ("CP 2, the layer-split cache's prefix fetch", 2,
     "graphcp run --device cuda --cp 2 --attention triton --kv-cache layer-split"),
    ("attention TP 2: heads split, the o_proj all-reduce in the graphs", 2,
     "graphcp run --device cuda --cp 1 --tp 2 --attention triton"),
    ("attention DP 2: replicas, the FFN's collectives, the agreed eager fallback", 2,
     "graphcp run --device cuda --cp 1 --dp 2 --attention triton --graph full"),
    ("pipeline stages: nccl point-to-point between stages", 2,
     "graphcp run --device cuda --cp 1 --pp 2 --attention triton"),
    ("MoE ep across ranks: the nccl all-to-all", 2,
     "graphcp run --device cuda --cp 2 --model default-moe --moe ep --attention triton"),
    ("DeepSeek V4 at CP 2", 2, "graphcp run --device cuda --cp 2 --model default-v4"),
    ("a linear-attention hybrid at CP 2: the scan's all-gathers (tails, maps) and, where fla imports, its second "
     "pass from the composed states", 2,
     "graphcp run --device cuda --cp 2 --model default-hybrid --dtype bfloat16 --attention triton"),
    ("the PD hand-off from several ranks", 2, "graphcp pd-demo --device cuda --cp 2"),
    ("decode over the sharded cache at CP 2: the LSE merge inside the decode graphs, each bucket's first replay "
     "checked", 2, "graphcp generate --device cuda --cp 2 --kv-cache sharded --verify-capture "
     "--input examples/requests.jsonl --output out.pt --max-new-tokens 16"),
)
