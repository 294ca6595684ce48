"""Ring attention over the token-sharded cache: the host-side plan of a forward's ring
(``plan``), pass-KV (``pass_kv``) and pass-Q (``pass_q``) over the shared step schedule
(``schedule``), their grow-only buffers (``buffers``), the log-sum-exp merge (``merge``),
the per-batch choice between the two (``exchange_choice``, reading ``hardware``), and the
engine's ring object (``attention``)."""
