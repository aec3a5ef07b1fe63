from layersplit.launch.cli import main

raise SystemExit(main())
