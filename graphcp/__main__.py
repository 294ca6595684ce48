from graphcp.cli import main

raise SystemExit(main())
