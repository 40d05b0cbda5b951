from megalite.cli import main

raise SystemExit(main())
