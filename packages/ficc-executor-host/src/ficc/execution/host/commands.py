"""The `ficc-executor` command's stable entry point.

The console script and `python -m ficc.execution` hand over to this module by name, so
it stays where it is whatever the layout of the commands behind it (`cli/`).
"""

import sys

from ficc.execution.host.cli.commands import console_main, main

__all__ = ["console_main", "main"]

if __name__ == "__main__":
    sys.exit(main())
