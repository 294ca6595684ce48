"""The names of graphcp's options: one home for ``RuntimeConfig``, the command line,
the tuner and the backends. Plain Python (the tuner runs without torch)."""

from __future__ import annotations

from typing import Literal, get_args

DtypeName = Literal["float32", "bfloat16", "float16"]
GraphMode = Literal["off", "breakable", "full"]
GraphBackendName = Literal["auto", "cuda", "trace"]
LayoutName = Literal["zigzag", "interleave"]
AttentionName = Literal["torch", "triton", "flashinfer", "trtllm", "auto"]
#: where a forward's KV lives: every rank holds the batch's KV ("replicated"), each rank its
#: own zigzag blocks ("sharded"), or each rank the cache of a contiguous range of layers plus
#: one scratch layer ("layer-split", docs/pd.md)
KVCacheMode = Literal["replicated", "sharded", "layer-split"]
#: how attention stays exact with a sharded cache ("auto": chosen per batch; the replicated
#: cache always all-gathers)
ExchangeName = Literal["auto", "pass-kv", "pass-q"]
#: what a forward ran (stats reports): the replicated cache's all-gather, or one of the rings
ExchangeKind = Literal["all-gather", "pass-kv", "pass-q"]
#: how a mixture-of-experts layer runs over the CP group: experts split over the ranks
#: (all-to-all dispatch and combine) or every expert sharded like the dense MLP
MoeLayout = Literal["ep", "tp"]
#: how a decode step over the token-sharded cache merges the ranks' partial attention
#: (docs/decode.md): "auto" takes the one that moves fewer bytes
DecodeMergeName = Literal["auto", "all-gather", "all-to-all"]

DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)
GRAPH_MODES: tuple[str, ...] = get_args(GraphMode)
GRAPH_BACKENDS: tuple[str, ...] = get_args(GraphBackendName)
LAYOUTS: tuple[str, ...] = get_args(LayoutName)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionName)
KV_CACHE_MODES: tuple[str, ...] = get_args(KVCacheMode)
EXCHANGES: tuple[str, ...] = get_args(ExchangeName)
EXCHANGE_KINDS: tuple[str, ...] = get_args(ExchangeKind)
MOE_LAYOUTS: tuple[str, ...] = get_args(MoeLayout)
DECODE_MERGES: tuple[str, ...] = get_args(DecodeMergeName)
#: the dtypes the command line offers (float16 is API-only: no parity tests in it yet)
CLI_DTYPES = ("float32", "bfloat16")
DEVICE_KINDS = ("cpu", "cuda")
