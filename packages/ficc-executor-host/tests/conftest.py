"""The daemon's own code runs in these tests' processes (the runner, the service
backends, the ledger, staging), so they run under the umask the shipped unit gives the
daemon (UMask=0077), never a developer shell's kinder 0022: a mode that only comes out
right under 0022 fails here as it would in production. The daemons that other suites
start get every setting of the unit from the test kit (`ficc_testkit.unit`)."""

from __future__ import annotations

import os

from ficc_testkit.unit import shipped_settings

os.umask(shipped_settings().umask)
