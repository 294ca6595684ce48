"""Cache placements, one module a cache mode (``RuntimeConfig.kv_cache``): which rank
holds which tokens and layers of a request (:mod:`~graphcp.kv.placement.base`, the
contract and its every-rank-holds-everything answers):

- :mod:`~graphcp.kv.placement.replicated`: every rank holds everything;
- :mod:`~graphcp.kv.placement.sharded`: a rank holds its zigzag blocks of every forward,
  and every rank keeps the same ledger of all of them (:mod:`~graphcp.kv.placement.ledger`);
- :mod:`~graphcp.kv.placement.layer_split`: a rank keeps its own layers, and the owner
  of a layer broadcasts a cached prefix of it before its attention.
"""
