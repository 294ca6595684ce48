"""The ``graphcp`` command line: ``main`` and its parser (``graphcp/cli/main.py``),
the shared runtime flags (``args.py``), the per-rank jobs (``jobs.py``) and the
request file reader (``requests.py``)."""
