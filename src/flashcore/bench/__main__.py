from flashcore.bench.cli import main

raise SystemExit(main())
