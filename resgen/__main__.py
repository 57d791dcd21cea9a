"""`python -m resgen ...` (the same as the `resgen` console script)."""

from .cli import main

raise SystemExit(main())
