"""``python -m quantd`` is the ``quantd`` command."""

from quantd.cli import main

raise SystemExit(main())
