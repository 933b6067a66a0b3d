"""Entry point of `python -m ficc.hoststate` (the read-only `inspect` command)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
