from meshagent.cli.main import main

raise SystemExit(main())
