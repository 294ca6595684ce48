"""Padding rows never carry uninitialised memory: a rank with fewer rows than the
largest runs the eager body on padded rows (token 0, position 0, slot -1), whose
attention output no backend writes. With every ``torch.empty_like`` /
``Tensor.new_empty`` filled with NaN (what uninitialised memory may hold), the logits
are bitwise those of a normal run and the KV pool holds no NaN (its scratch page
takes the padding rows' K/V: a NaN there made ``torch.equal`` of two snapshots of an
unchanged pool false, and the capture self-check compares pools so)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import launch


def _nan_empty(group, model: str, poisoned: bool, dtype: str):
    eng = PrefillEngine(model, RuntimeConfig(dtype=dtype, kv_tokens=1024), group)
    rng = np.random.default_rng(2)
    lens = [5, 3]  # 8 tokens at CP 2 in 2C blocks of 1: uneven rank rows, padding on one rank
    saved = torch.empty_like, torch.Tensor.new_empty
    if poisoned:
        torch.empty_like = lambda t, **kw: torch.full_like(t, float("nan"), **kw)
        torch.Tensor.new_empty = lambda t, *size, **kw: saved[1](t, *size, **kw).fill_(float("nan"))
    try:
        h = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, 7))]).handles[0]
        out = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, n), h if j == 0 else None)
                           for j, n in enumerate(lens)], all_logits=True)
    finally:
        torch.empty_like, torch.Tensor.new_empty = saved
    return [x.clone() for x in out.logits], bool(torch.isnan(eng.parts.kv.pool).any())


@pytest.mark.parametrize("model, dtype", [("default", "float32"), ("default", "bfloat16"),
                                          ("default-moe", "bfloat16"), ("default-dsa", "float32")])
def test_padding_rows_carry_no_uninitialised_memory(model, dtype):
    clean = launch(_nan_empty, 2, model, False, dtype)
    poisoned = launch(_nan_empty, 2, model, True, dtype)
    for rank, ((want, _), (got, nan_in_pool)) in enumerate(zip(clean, poisoned)):
        assert not nan_in_pool, f"rank {rank}: the KV pool holds NaN from a padding row"
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"rank {rank}: logits changed"
