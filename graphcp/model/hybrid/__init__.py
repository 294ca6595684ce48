"""Linear-attention hybrids (docs/hybrid.md): Qwen3.5, Qwen3.5-MoE and Qwen3-Next, whose
layers are mostly Gated DeltaNet (a gated delta-rule recurrence after a short causal
convolution) with a full-attention layer every few. Under prefill CP the recurrence is
carried across ranks by an exact parallel scan of its blocks' affine maps (``scan.py``); a
decode step advances each request's states by one token (``step.py``)."""
