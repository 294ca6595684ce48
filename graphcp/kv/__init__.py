"""The paged KV cache, built from three parts (:mod:`~graphcp.kv.paged` composes them,
:mod:`~graphcp.kv.factory` builds it from a cache mode and a geometry):

- the **allocator**: :mod:`~graphcp.kv.allocator` (pages, the free stack, a batch's
  reservation and rollback) over :mod:`~graphcp.kv.page_table` (the dense page table,
  its rows, the page-table and slot gathers);
- the **placement**, one a cache mode (:mod:`~graphcp.kv.placement`): which rank holds
  which tokens and layers (replicated, token-sharded with its ledger, layer-split);
- the **storage**, one a geometry (:mod:`~graphcp.kv.storage`): what a token or layer
  holds (K/V heads here; a family whose tokens hold something else keeps its storage in
  its folder, graphcp.model.<family>, and registers it).

Beside them: :mod:`~graphcp.kv.handle` (the handles and the reservation's errors),
:mod:`~graphcp.kv.handle_check` (a batch's prefix checks), :mod:`~graphcp.kv.layers`
(which layers a rank keeps, where each lives in a pool), :mod:`~graphcp.kv.spec` (what
sizes a cache), :mod:`~graphcp.kv.layout` (a layer's page layout, views and the slot
write), :mod:`~graphcp.kv.spans` (which rank exports which part of a request) and
:mod:`~graphcp.kv.decode` (a decode step's reservation).

Everything here sits below attention: a backend reads a cache, a cache never imports a backend.
"""
