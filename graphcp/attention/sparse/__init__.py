"""DeepSeek Sparse Attention: the lightning indexer's scores and top-k (``topk``), the
sparse MLA contract and its torch reference (``mla``), and the Triton sparse MLA backend
(``triton``, over :mod:`graphcp.attention.kernels.sparse_mla`)."""
