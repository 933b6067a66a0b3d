"""Entry point of `python -m ficc.hoststate` (the read-only `inspect` command)."""

from .cli import main

raise SystemExit(main())
