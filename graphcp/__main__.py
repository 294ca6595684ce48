"""``python -m graphcp``. A Ctrl-C during the command line's own imports, before ``main``
holds SIGINT's handler, is exit 130 and one line too (as anywhere later: cli/main.py)."""

try:
    from graphcp.cli.main import main
except KeyboardInterrupt:
    import sys

    exec("")  # CPython 3.11 marks a KeyboardInterrupt leaving exec()'d code as uncaught: clear it
    command = sys.argv[1:2] if sys.argv[1:2] and not sys.argv[1].startswith("-") else []
    print(" ".join(["graphcp", *command]) + ": interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
