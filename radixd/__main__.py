from radixd.cli import main

raise SystemExit(main())
