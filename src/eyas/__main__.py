from eyas.cli import main

raise SystemExit(main())
