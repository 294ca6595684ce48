"""EAGLE-3 speculative-decoding drafts (docs/speculative.md): the checkpoint's config
(config.py), its tensors (checkpoint.py), the draft layer (layer.py) and the aligned
inputs of a CP prefill (shift.py)."""
