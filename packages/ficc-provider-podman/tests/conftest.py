"""The provider's driver runs inside the daemon's process, so these tests run it under
the umask the shipped unit gives the daemon (UMask=0077), never a developer shell's
kinder 0022: a file the provider makes that the slot account must read has to come out
right under 0077, as it does in production. What the tests themselves set up for the
slot account (its slot directory, the image archive, a local input) they give its mode
explicitly."""

from __future__ import annotations

import os

from ficc_testkit.unit import shipped_settings

os.umask(shipped_settings().umask)
