"""Helpers for multi-rank tests: tiny checkpoints and seeded batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from helpers import rel_err  # noqa: F401 - re-exported for the CP tests

from graphcp.runtime.engine import prefill_after_prefixes

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def write_tiny_llama(folder: Path, seed: int = 0, **config) -> Path:
    """A tiny Llama written with transformers: untied, norms perturbed; by default 2 layers
    with llama3 RoPE scaling (``config`` replaces any of the LlamaConfig arguments)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
              rope_scaling=LLAMA3_SCALING)
    model = LlamaForCausalLM(LlamaConfig(**{**kw, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def batch(rng: np.random.Generator, vocab: int, lens, prefix_lens=None):
    """(prefix tokens or None, new tokens) per request."""
    prefix_lens = prefix_lens or [0] * len(lens)
    out = []
    for n, p in zip(lens, prefix_lens):
        out.append((rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)))
    return out


def run_batch(engine, reqs, all_logits=True):
    """Prefill the prefixes (one forward), then the new tokens extending them; release."""
    out = prefill_after_prefixes(engine, reqs, all_logits)
    for h in out.handles:
        engine.release(h)
    return out
