from graphcp.cli.main import main

raise SystemExit(main())
