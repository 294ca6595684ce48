"""The ``graphcp`` command line: ``main`` and its parser (``main.py``, which wires every
application's subcommand), the jobs behind ``prefill`` and ``run`` (``jobs.py``), the
request and conversation file reader (``requests.py``), the input files read before
anything heavy (``inputs.py``), ``pd-demo`` (``pd_demo.py``) and ``serve-prefill``
(``serve_prefill.py``, over :mod:`graphcp.serve`). The runtime
flags and job spec it shares with ``profile`` live in :mod:`graphcp.jobs`."""
