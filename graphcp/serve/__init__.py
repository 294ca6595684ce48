"""``graphcp serve-prefill``: a prefill worker that stays up (docs/pd.md, "serve-prefill").

Rank 0 owns a local socket (:mod:`graphcp.serve.frontend`): clients send requests as JSON
lines (:mod:`graphcp.serve.protocol`), each naming its decode side's address and its
tokens; a bad line, an oversized request or a decode side it cannot reach is refused at
once, before any page is reserved. Every rank runs the same loop
(:mod:`graphcp.serve.worker`): rank 0 forms a batch under the buckets
(:mod:`graphcp.serve.batcher`) and broadcasts it, every rank prefills it, each request's
KV goes to its decode side (:mod:`graphcp.serve.transports`: a folder, or a Mooncake
receiver) and is released, and rank 0 replies one line a request.
"""
