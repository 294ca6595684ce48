"""What is decode's own (docs/decode.md): a decode step is a prepared batch of the decode
phase run through the one forward (graphcp.runtime.forward, graphcp.runtime.capture), so
only its planning, its driver and what is built on it are here:

- ``plan``: the decode phase's planner: a step's checks (every refusal a BatchError that
  changes nothing), its fingerprint, the cache mode's reservation, its attention metadata;
- ``decoder``: a step end to end (the engine's ``decode``);
- ``generate``: greedy generation and conversations over prefill and decode;
- ``speculative``: speculative decoding with an EAGLE-3 draft (a verify step is a decode
  step of k + 1 rows a request).
"""
