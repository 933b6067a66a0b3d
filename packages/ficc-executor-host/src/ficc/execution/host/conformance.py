"""The provider conformance kit's public path: `python -m ficc.execution.host.conformance`.

The kit itself lives in `cli/conformance`; this module keeps the documented command
and import path stable.
"""

import sys

from ficc.execution.host.cli.conformance import (
    CHECK_REFUSAL,
    RULES,
    USAGE,
    Kit,
    Outcome,
    RuleFailed,
    main,
)

__all__ = ["CHECK_REFUSAL", "RULES", "USAGE", "Kit", "Outcome", "RuleFailed", "main"]

if __name__ == "__main__":
    sys.exit(main())
