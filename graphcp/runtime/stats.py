"""What each rank did: ``PrefillEngine.stats()`` and the file ``graphcp prefill --stats``
writes. Other tools read these names (keys may be added, never renamed)::

    {"ranks": [{"rank": 0, "cp_size": 4, "world_rank": 0, "stage": 0, "layers": [0, 32],
                "mesh": {"stage": 0, "dp": 0, "cp": 0, "attn_tp": 0}, "tp_size": 4, "attn_tp_size": 1,
                "dp_size": 1, "kv_heads": N,
                "kv_cache": "sharded", "exchange": "auto",
                "kv_pool_tokens": N, "kv_pool_bytes": N, "kv_pools": {"kv_cache": N, ...},
                "kv_state_pools": {"linear_recurrent": N, ...},
                "kv_stored_tokens": N, "kv_stored_pages": N,
                "forwards": [{"path": "graph" | "eager", "bucket": N | null,
                              "exchange": "all-gather" | "pass-kv" | "pass-q",
                              "new_tokens": N, "cached_tokens": N, "bytes_received": N,
                              "bytes_received_per_layer": N, ...}, ...],
                "forwards_dropped": N,
                "decode_steps": [{"path": "graph" | "eager", "bucket": N | null, "fallback": null | "...",
                                  "rows": N, "cached_tokens": N, "decode_merge": "local" | "all-gather" |
                                  "all-to-all", "bytes_merged": N, "bytes_merged_per_layer": N,
                                  "launches": N | null, "time_s": X}, ...],
                "decode_steps_dropped": N}, ...]}

``rank`` is the rank in its CP group, ``world_rank`` in the whole run (stage-major
under pipeline stages), ``stage`` its pipeline stage and ``layers`` the ``[first, end)``
decoder layers it runs; ``mesh`` its (dp, cp, attn_tp) coordinates (docs/parallel.md)
and ``kv_heads`` the KV heads its cache stores (the model's, split over attention TP);
``kv_pools`` each page pool's bytes (one for most models; MLA's latent and indexer
keys; DeepSeek V4's window, source rows and entries per layer kind), ``kv_state_pools``
each per-request state pool's (a linear-attention hybrid's recurrent and conv states;
``kv_pool_bytes`` counts both);
under attention DP a forward's ``dp_assignment`` lists each request's replica.
``kv_pool_*`` describe one rank's pool; ``kv_stored_tokens`` counts the tokens whose
KV the rank holds at the end (live handles). ``decode_steps`` lists every decode step
(docs/decode.md): its path (a decode graph's bucket, or eager and why), its requests
(``rows``) and their cached tokens, how the ranks' partial attention was merged and the
bytes this rank received for it, and on the graph path the launches it took. ``forwards`` lists every forward in
order (the command line prefills prefixes first, so a request with a prefix
contributes two; under pipeline stages each micro-batch is a forward), each with every
key of its ``ForwardInfo.stats``: besides those above, ``exchange_choice`` (the
per-batch rule's inputs and thresholds, sharded cache) and whatever other parts record there. An engine keeps the last
:data:`HISTORY` forwards (``forwards_dropped`` counts older ones).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

from graphcp.attention.phase import DECODE
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.runtime.batch import ForwardInfo, PreparedBatch

HISTORY = 100_000


def forward_entry(info: ForwardInfo) -> dict[str, Any]:
    """One forward as the stats list it: path, bucket (graph path only), then every key
    of its ``stats``."""
    return {"path": info.path, "bucket": info.capacity if info.path == "graph" else None, **info.stats}


class Recorder:
    """A rank's forwards as the stats list them (the last :data:`HISTORY`): each forward's
    figures completed with what its batch and exchange say."""

    def __init__(self, exchange, num_layers: int) -> None:
        """``exchange``: the KV exchange (it says what a forward's plan ran);
        ``num_layers``: the stage's layers (the per-layer bytes' divisor)."""
        self.exchange, self.num_layers = exchange, num_layers
        self.forwards: deque[dict] = deque(maxlen=HISTORY)
        self.seen = 0
        self.decode_steps: deque[dict] = deque(maxlen=HISTORY)
        self.decode_seen = 0

    def record(self, prep: PreparedBatch, info: ForwardInfo) -> None:
        """The forward's figures into its ForwardInfo.stats, and the entry into its phase's
        history (``forwards``, or ``decode_steps``)."""
        if prep.phase == DECODE:
            self._record_step(prep, info)
            return
        st = info.stats
        choice = self.exchange.describe(prep.kv_plan)
        st["exchange"] = choice.pop("exchange")
        st["new_tokens"] = prep.plan.num_tokens
        st["cached_tokens"] = int(prep.plan.prefix_lens.sum())
        st[KV_RECEIVED] = st.get(KV_RECEIVED, 0)
        st["bytes_received_per_layer"] = st[KV_RECEIVED] // self.num_layers
        st.update(choice)  # the ring's per-batch choice
        self.forwards.append(forward_entry(info))
        self.seen += 1

    def _record_step(self, prep: PreparedBatch, info: ForwardInfo) -> None:
        """A decode step's figures: its rows and cached tokens, the merge it ran and the bytes
        it received, its launches (graph path), then what the forward counted."""
        merged = int(info.stats.pop(KV_RECEIVED, 0))
        figures = {"rows": prep.rows, "cached_tokens": int(prep.decode.positions.sum()),
                   **self.exchange.decode.describe(prep.kv_plan), "bytes_merged": merged,
                   "bytes_merged_per_layer": merged // self.num_layers, "launches": info.launches, **info.stats}
        info.stats = figures
        self.decode_steps.append({"path": info.path, "bucket": info.bucket, "fallback": info.fallback, **figures})
        self.decode_seen += 1

    @property
    def dropped(self) -> int:
        return self.seen - len(self.forwards)

    @property
    def decode_dropped(self) -> int:
        return self.decode_seen - len(self.decode_steps)

    def reset(self) -> None:
        self.forwards.clear()
        self.seen = 0
        self.decode_steps.clear()
        self.decode_seen = 0


def write_stats(path: str | os.PathLike, ranks: list[dict[str, Any]]) -> None:
    """Write ``{"ranks": ranks}`` as JSON to ``path`` (the command line writes it to a
    temporary file it then renames with its other outputs: graphcp/cli/commands.py)."""
    Path(path).write_text(json.dumps({"ranks": ranks}, indent=1) + "\n")
