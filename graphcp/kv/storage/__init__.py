"""Cache storages: what a token or a layer of a paged cache holds, and where
(:mod:`~graphcp.kv.storage.base`, the contract). Here the one a dense model's tokens
need, K and V of the KV heads (:mod:`~graphcp.kv.storage.kv_heads`); a family whose
tokens hold something else keeps its storage in its folder (graphcp.model.<family>)
and registers it (:func:`graphcp.kv.factory.register_storage`).
"""
