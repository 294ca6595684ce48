"""DeepSeek Sparse Attention models (DeepSeek V3.2, GLM-5): MLA with the lightning
indexer (``mla.py``), the decoder (``model.py``), RoPE as these models apply it
(``rope.py``) and the checkpoint's tensors (``checkpoint.py``); the family's cache
(``cache.py``, ``layer_split.py``), sparse attention (``sparse.py``, ``sparse_triton.py``,
``topk.py``), export format (``export.py``) and transformers cache (``hf_cache.py``),
which ``family.py`` registers."""
