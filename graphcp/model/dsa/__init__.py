"""DeepSeek Sparse Attention models (DeepSeek V3.2, GLM-5): MLA with the lightning
indexer (``mla.py``), DeepSeek's MoE (``moe.py``), the decoder (``model.py``), RoPE as
these models apply it (``rope.py``) and the checkpoint's tensors (``checkpoint.py``)."""
