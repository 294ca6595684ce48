"""The draft's aligned inputs under CP: its input ids are the target's ids shifted left
by one *per request*, each request's last row taking the token that follows it (the
target's sample, or the next prompt token a chunked prefill knows), and the shift is
made on the whole batch *before* the layout shards it. Row i of the draft's input then
sits on the rank that holds row i of the target's hidden states, whatever the layout
(zigzag, interleave): the hidden states never move (docs/speculative.md)."""

from __future__ import annotations

import numpy as np


def shifted_ids(flat: np.ndarray, extend: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    """int64 [tokens]: per request ``tokens[1:] + [next_tokens[j]]`` (``flat``: the
    batch's ids in batch order, ``extend``: each request's count)."""
    out = np.empty_like(flat)
    out[:-1] = flat[1:]
    out[np.cumsum(extend) - 1] = next_tokens
    return out


def draft_input_ids(flat: np.ndarray, extend: np.ndarray, next_tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """This rank's draft input ids: the shifted batch at the rank's rows (``rows``: the
    layout's indices of its rows in batch order). No collective."""
    return shifted_ids(flat, extend, next_tokens)[rows]
