"""A seeded random EAGLE-3 draft for a target checkpoint (the public format graphcp loads,
graphcp/model/eagle3/checkpoint.py), written once next to the presets, for the GPU check's
draft graphs: its shapes are the target's (hidden size, heads, KV heads, head_dim,
vocabulary), its draft vocabulary a quarter of the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.checkpoint import draft_tensors
from graphcp.model.eagle3.config import ARCHITECTURE, read_eagle3_config
from graphcp.model.presets import cache_root, ensure_model_folder

#: the version of random_draft's recipe (bump it when it writes other bytes: cached drafts
#: are written again)
RECIPE = 1


def draft_config(target: dict) -> dict:
    """config.json of a draft for the target ``config.json`` ``target``: one Llama layer
    of its sizes, fed by its first, middle and last decoder layers."""
    layers = target["num_hidden_layers"]
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_theta")
    return {"architectures": [ARCHITECTURE], "model_type": "llama", **{k: target[k] for k in keys},
            "intermediate_size": 2 * target["hidden_size"], "num_hidden_layers": 1,
            "draft_vocab_size": max(1, target["vocab_size"] // 4), "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}}


def random_draft(folder: Path, target: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors under the checkpoint's names for the draft whose config.json is in
    ``folder``: weights ~ 1/sqrt(fan-in), norms near 1, and a vocabulary map (``d2t``,
    ``t2d``) onto distinct target ids."""
    cfg = read_eagle3_config(folder, target)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, shape) in draft_tensors(cfg).items():
        if name in ("d2t", "t2d"):
            continue
        w = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.1 * w if len(shape) == 1 else w * shape[-1] ** -0.5
    vocab, draft_vocab = cfg.layer.vocab_size, cfg.draft_vocab_size
    ids = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
    out["d2t"] = torch.from_numpy(ids - np.arange(draft_vocab)).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    out["t2d"] = t2d
    return out


def ensure_random_draft(target_dir: Path, label: str, seed: int = 0) -> Path:
    """The draft folder for the target checkpoint ``target_dir`` (``label`` names it),
    written on first use (atomically) under the presets' cache, and again when the
    target's shapes or the draft's recipe changed."""
    folder = cache_root() / "models" / f"{label}-eagle3-draft"
    target_json = json.loads((Path(target_dir) / "config.json").read_text())
    target = ModelConfig.from_file(Path(target_dir) / "config.json")
    recipe = {"family": "eagle3 draft", "recipe": RECIPE, "seed": seed}
    return ensure_model_folder(folder, draft_config(target_json), recipe,
                               lambda tmp: random_draft(tmp, target, seed))
