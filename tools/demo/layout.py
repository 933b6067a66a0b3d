"""Where everything of one demo run lives, derived from the run directory (pure).

Everything is below one root-owned directory under /run (not /tmp: the daemon refuses
a configuration, state or socket directory with a group- or other-writable ancestor).
The directory stays after the run so a newcomer can look at the ledger, the log, the
attempt's files and the configuration; the next run removes it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_BASE = Path("/run/ficc-demo")
"""All runs live below this directory; each run in its own subdirectory."""

DISK_BASE = Path("/var/lib/ficc-demo")
"""Where each run's slot image file lives: on disk, since /run is often a small tmpfs."""

TRANSPORT_ACCOUNT = "ficc-demo-transport"
"""The account of the controller's transport: the only one that may use transport.sock."""

SLOT_ACCOUNT = "ficc-demo-slot"
"""The account the job runs as (rootless Podman), one per slot."""

SLOT_ID = "s0"
SLOT_CLASS = "demo"
PROVIDER = "podman"
IMAGE_TAG = "localhost/ficc-demo:1"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run, all below `root` (see the module docstring)."""

    root: Path

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def config_file(self) -> Path:
        return self.config_dir / "executor-host.json"

    @property
    def state_dir(self) -> Path:
        """The daemon's ledger (root 0700)."""
        return self.root / "state"

    @property
    def socket_dir(self) -> Path:
        """transport.sock and admin.sock (root 0711)."""
        return self.root / "sockets"

    @property
    def transport_socket(self) -> Path:
        return self.socket_dir / "transport.sock"

    @property
    def admin_socket(self) -> Path:
        return self.socket_dir / "admin.sock"

    @property
    def slot_dir(self) -> Path:
        """The slot's own filesystem (mounted here): attempt layouts and the slot's
        Podman storage."""
        return self.root / "slots" / SLOT_ID

    @property
    def slot_image(self) -> Path:
        """The ext4 image file behind the slot, on disk (`DISK_BASE`, not /run)."""
        return DISK_BASE / self.root.name / f"{SLOT_ID}.img"

    @property
    def wheel_dir(self) -> Path:
        return self.root / "wheels"

    @property
    def provider_prefix(self) -> Path:
        """The root-owned prefix the provider wheel is installed into (pip --prefix)."""
        return self.root / "provider"

    @property
    def image_dir(self) -> Path:
        return self.root / "image"

    @property
    def controller_dir(self) -> Path:
        """The controller's own files (saved bindings, plan, collected results),
        owned by the transport account."""
        return self.root / "controller"

    @property
    def daemon_log(self) -> Path:
        return self.root / "daemon.log"

    @property
    def daemon_pid(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def notify_socket(self) -> Path:
        return self.root / "notify.sock"
