"""``python -m kvxferd``: the same as the ``kvxferd`` console script."""

from kvxferd.cli import main

raise SystemExit(main())
