"""``python -m autoshard`` runs the same command line as the ``autoshard`` script."""

from autoshard.cli import main

raise SystemExit(main())
