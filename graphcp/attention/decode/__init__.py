"""A decode step's attention (docs/decode.md): each rank attends one new query row per
request over the KV it holds, and the partial results are made whole.

- ``merge``: the exact merge of the ranks' partial outputs by their log-sum-exp, as one
  all-gather or as an all-to-all plus an all-gather, its bytes per layer (the formula)
  and the choice between the two by those bytes;
- ``phases``: the decode phase of each KV exchange (the replicated and layer-split caches'
  local attention, the token-sharded cache's partial attention and merge);
- ``paged``: paged decode attention over static device metadata (a page table and the
  lengths), in plain torch operations: what a decode graph captures on any device.
"""
