"""The paged KV caches, one module a cache mode:

- :mod:`~graphcp.kv.layout`: a layer's page layout (``NHD``/``HND``), views and the slot write;
- :mod:`~graphcp.kv.spans`: which rank holds which (layer, positions) of a request;
- :mod:`~graphcp.kv.paged`: the paged pool, its page allocator, page tables and handles;
  as it is, the replicated cache (every rank holds every request's KV);
- :mod:`~graphcp.kv.sharded`: the token-sharded cache (a rank holds its zigzag blocks);
- :mod:`~graphcp.kv.layer_split`: LayerSplit (a rank holds its layers + one scratch layer).

A family whose tokens hold something else than K/V heads keeps its caches in its own
folder (graphcp.model.<family>) and registers them (:func:`graphcp.kv.factory.register_cache`).

Everything here sits below attention: a backend reads a cache, a cache never imports a backend.
"""
