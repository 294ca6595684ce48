"""Decoding over the engine's cache (docs/decode.md): ``PrefillEngine.decode`` (one new
token for each of a batch of live requests), ``generate`` (greedy, multi-turn) on top.

- ``batch``: a step's checks (every refusal a BatchError that changes nothing), its
  reservation and host metadata, and what it returns;
- ``step``: the step's forward: every rank runs every request's new row, each layer
  stores and attends through the exchange's decode step (graphcp.attention.decode);
- ``graphs``: decode graphs, one per batch-size bucket, attention and merge inside;
- ``decoder``: a step end to end (the engine's ``decode``);
- ``generate``: greedy generation and conversations over prefill and decode.
"""
