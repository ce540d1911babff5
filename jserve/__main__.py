from jserve.cli import main

raise SystemExit(main())
