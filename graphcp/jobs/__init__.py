"""What the ``graphcp`` commands share below all of them: a job's spec and running it on
local ranks (``spec``), the runtime flags that make a spec (``args``), and the op counter
(``op_counter``). Nothing in the library imports this package."""
