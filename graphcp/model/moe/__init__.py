"""Mixture-of-experts layers: the router, the grouped expert compute, and the two ways
of running the experts over the CP group (``tp``: every expert sharded like the dense
MLP; ``ep``: experts split over the ranks, all-to-all dispatch and combine)."""
