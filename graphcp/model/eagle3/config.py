"""An EAGLE-3 draft's config.json (SGLang's ``LlamaForCausalLMEagle3``; SpecForge and
the EAGLE repository write the same keys), checked against its target model.

The draft is one Llama decoder layer whose q/k/v read ``2 * hidden`` inputs; its
attention's shape (heads, KV heads, head_dim) and its hidden size must be the target's:
the draft's KV lives in the target's cache as one more layer, and it embeds with the
target's embedding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from graphcp.checks import check_bool, check_int
from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """SGLang's default when a checkpoint names no layers: it captures the *inputs* of
    layers ``2, L // 2, L - 3``, i.e. the outputs of decoder layers ``1, L // 2 - 1,
    L - 4`` (the ids this module speaks in)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class Eagle3Config:
    """``layer``: the draft layer's sizes (a Llama ModelConfig); ``aux_layer_ids``: the
    target decoder layers whose outputs, concatenated in this order, feed ``fc``
    (layer k: transformers' ``hidden_states[k + 1]``; the last layer's before the final
    norm); ``ids_from``: "checkpoint" or "default" (:func:`default_layer_ids`)."""

    layer: ModelConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    ids_from: str
    fc_bias: bool

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def read_eagle3_config(folder: str | Path, target: ModelConfig) -> Eagle3Config:
    """The draft's config, checked against ``target``; ConfigError naming the file, key
    and value otherwise."""
    path = Path(folder) / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"draft: no config.json at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
    src = str(path)
    if d.get("architectures") != [ARCHITECTURE]:
        raise ConfigError(f"{src}: architectures must be [{ARCHITECTURE!r}] (an EAGLE-3 draft), "
                          f"got {d.get('architectures')!r}"[:300])
    layers = check_int(d.get("num_hidden_layers", 1), "num_hidden_layers", lo=1, hi=1 << 12, where=src)
    if layers != 1:
        raise ConfigError(f"{src}: num_hidden_layers={layers}; graphcp runs EAGLE-3 drafts of one layer (midlayer)")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if d.get(key) is not None and check_bool(d[key], key, where=src):
            raise ConfigError(f"{src}: {key}=true is not an EAGLE-3 draft graphcp runs (expected false)")
    # the layer's sizes and RoPE as any Llama's (the keys are checked there)
    layer = ModelConfig.from_hf_dict(dict(d, architectures=["LlamaForCausalLM"]), source=src)
    for key, mine, theirs in (("hidden_size", layer.hidden_size, target.hidden_size),
                              ("num_attention_heads", layer.num_heads, target.num_heads),
                              ("num_key_value_heads", layer.num_kv_heads, target.num_kv_heads),
                              ("head_dim", layer.head_dim, target.head_dim),
                              ("vocab_size", layer.vocab_size, target.vocab_size)):
        if mine != theirs:
            raise ConfigError(f"{src}: {key}={mine}, the target model has {theirs}; the draft shares the target's "
                              "embedding and KV cache, so they must match")
    th = d.get("target_hidden_size")
    if th is not None and check_int(th, "target_hidden_size", lo=1, hi=1 << 20, where=src) != target.hidden_size:
        raise ConfigError(f"{src}: target_hidden_size={th}, the target model has hidden_size={target.hidden_size}")
    vocab = d.get("draft_vocab_size")
    vocab = layer.vocab_size if vocab is None else check_int(vocab, "draft_vocab_size", lo=1, hi=layer.vocab_size,
                                                             where=src)
    eagle = d.get("eagle_config")
    ids = None if not isinstance(eagle, dict) else eagle.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and not isinstance(eagle, dict):
        raise ConfigError(f"{src}: eagle_config must be an object, got {eagle!r}"[:300])
    ids_from = "checkpoint"
    if ids is None:
        ids, ids_from = default_layer_ids(target.num_layers), "default"
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or len(ids) != 3:
        raise ConfigError(f"{src}: eagle_config.eagle_aux_hidden_state_layer_ids must list 3 target layers, "
                          f"got {ids!r}"[:300])
    for i, k in enumerate(ids):
        what = "eagle_config.eagle_aux_hidden_state_layer_ids" if ids_from == "checkpoint" else (
            "SGLang's default layer ids (1, L // 2 - 1, L - 4; give eagle_config.eagle_aux_hidden_state_layer_ids)")
        check_int(k, f"{what}[{i}] (a target decoder layer)", lo=0, hi=target.num_layers - 1, where=src)
    fc_bias = d.get("bias")
    return Eagle3Config(layer, vocab, tuple(int(k) for k in ids), ids_from,
                        bool(fc_bias is not None and check_bool(fc_bias, "bias", where=src)))
