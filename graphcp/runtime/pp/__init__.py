"""Pipeline parallelism across CP groups: stage groups and links (groups.py), the
split of a batch into micro-batches (microbatch.py) and one stage's schedule
(schedule.py). The engine runs a stage's body through them."""
