"""The ``graphcp`` command line: ``main`` and its parser (``main.py``, which wires every
application's subcommand), the jobs behind ``prefill`` and ``run`` (``jobs.py``), the
request file reader (``requests.py``) and ``pd-demo`` (``pd_demo.py``). The runtime
flags and job spec it shares with ``profile`` live in :mod:`graphcp.jobs`."""
