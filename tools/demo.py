#!/usr/bin/env python3
"""One real job through the ficc executor host daemon and the Podman provider.

Run as root on Debian 12 through the README's command, `tools/dev demo` (which
installs the Debian packages, a virtual environment with nox, and runs `nox -s demo`:
every distribution installed in the session's environment, then this script). What it
does, step by step, is in tools/demo/main.py; the pieces are in tools/demo/.

    python tools/demo.py [--base DIR]     (default /run/ficc-demo)
"""

from __future__ import annotations

# `python tools/demo.py` puts tools/ first on sys.path: `demo` is the tools/demo package.
from demo.main import main

if __name__ == "__main__":
    raise SystemExit(main())
