"""``python -m stam.cli``: the ``stam`` command (benchmarks and tests start workers this way)."""

from stam.cli import main

raise SystemExit(main())
