"""The runtime: a batch prepared (``batch``), the transformer body run (``body``), graphs
captured and replayed per bucket (``capture/``), pipeline stages (``pp/``), the engine
that ties them together (``engine``) and what it reports (``stats``)."""
