"""What each rank did: ``PrefillEngine.stats()`` and the file ``graphcp prefill --stats``
writes. Other tools read these names (keys may be added, never renamed)::

    {"ranks": [{"rank": 0, "cp_size": 4, "world_rank": 0, "stage": 0, "layers": [0, 32],
                "mesh": {"stage": 0, "dp": 0, "cp": 0, "attn_tp": 0}, "tp_size": 4, "attn_tp_size": 1,
                "dp_size": 1, "kv_heads": N,
                "kv_cache": "sharded", "exchange": "auto",
                "kv_pool_tokens": N, "kv_pool_bytes": N, "kv_pools": {"kv_cache": N, ...},
                "kv_stored_tokens": N, "kv_stored_pages": N,
                "forwards": [{"path": "graph" | "eager", "bucket": N | null,
                              "exchange": "all-gather" | "pass-kv" | "pass-q",
                              "new_tokens": N, "cached_tokens": N, "bytes_received": N,
                              "bytes_received_per_layer": N, ...}, ...],
                "forwards_dropped": N}, ...]}

``rank`` is the rank in its CP group, ``world_rank`` in the whole run (stage-major
under pipeline stages), ``stage`` its pipeline stage and ``layers`` the ``[first, end)``
decoder layers it runs; ``mesh`` its (dp, cp, attn_tp) coordinates (docs/parallel.md)
and ``kv_heads`` the KV heads its cache stores (the model's, split over attention TP);
``kv_pools`` each page pool's bytes (one for most models; MLA's latent and indexer
keys; DeepSeek V4's window, source rows and entries per layer kind);
under attention DP a forward's ``dp_assignment`` lists each request's replica.
``kv_pool_*`` describe one rank's pool; ``kv_stored_tokens`` counts the tokens whose
KV the rank holds at the end (live handles). ``forwards`` lists every forward in
order (the command line prefills prefixes first, so a request with a prefix
contributes two; under pipeline stages each micro-batch is a forward), each with every key of its ``ForwardInfo.stats``: besides those
above, ``exchange_choice`` (the per-batch rule's inputs and thresholds, sharded
cache) and whatever other parts record there. An engine keeps the last
:data:`HISTORY` forwards (``forwards_dropped`` counts older ones).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graphcp.runtime.batch import ForwardInfo

HISTORY = 100_000


def forward_entry(info: ForwardInfo) -> dict[str, Any]:
    """One forward as the stats list it: path, bucket (graph path only), then every key
    of its ``stats``."""
    return {"path": info.path, "bucket": info.capacity if info.path == "graph" else None, **info.stats}


def write_stats(path: str | os.PathLike, ranks: list[dict[str, Any]]) -> None:
    """Write ``{"ranks": ranks}`` as JSON, replacing ``path`` whole or not at all."""
    p = Path(path)
    tmp = p.with_name(f"{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"ranks": ranks}, indent=1) + "\n")
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
