"""The integration suite's host: a daemon with the test provider, two slots, real accounts.

The accounts are `ficc-it-transport`, `-owner`, `-slot0`, `-slot1` and `-other` (a
stranger); each daemon gets two real slot filesystems, a root 0600 configuration built
from `Config` (`Layout.create`), and the test provider pinned by its real digest and
configured to log every call, so a test can count what the daemon asked of it.
`Daemon` is the driver plus the process and the suite's plan defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ficc.execution.host.config.model import Config, Provider
from ficc.execution.plan import Plan
from ficc_testkit import configs
from ficc_testkit.accounts import Accounts
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.digests import fake
from ficc_testkit.driver import Driver, StreamedInput
from ficc_testkit.slots import SlotFilesystem, slot_filesystems
from ficc_testkit.units import GIB, MIB
from ficc_testkit.wheels import InstalledProvider

PREFIX = "ficc-it-"
ACCOUNTS = ("transport", "owner", "slot0", "slot1", "other")
SLOT_BYTES = 64 * MIB
SLOT_INODES = 4_000
"""Each test daemon's two slots: real ext4 filesystems this size (loop-mounted)."""
SLOT_CLASS = "small"
PROJECT = "3" * 32
IMAGE = fake("0")
PROVIDER_CALLS = "provider-calls.log"
PROVIDER_BATCHES = "provider-batches.log"
"""The test provider appends `<method> <attempt_id>` here for every row of every call."""


def ensure_accounts(prefix: str = PREFIX) -> Accounts:
    """The suite's five accounts (see the module docstring)."""
    return Accounts.ensure(prefix, ACCOUNTS)


MINIMUM_LIMITS = {"memory_bytes": 4 * MIB, "processes": 2}
"""What the suite's test provider states its runtime needs (a shell barrier: far less
than any plan of the suite asks), so every admission checks a stated minimum."""


def provider_entry(digest: str, base: Path) -> Provider:
    """The test provider, pinned; `service`: the host's system service runs its barrier
    as the slot account, unconfined, so the payload gate refuses it."""
    return configs.provider(
        "test",
        digest,
        {
            "runtime": "service",
            "call_log": str(base / PROVIDER_CALLS),
            "batch_log": str(base / PROVIDER_BATCHES),
            "minimum_limits": MINIMUM_LIMITS,
        },
    )


class Layout(configs.Layout):
    """A test-provider daemon's layout, and what the provider logged."""

    @classmethod
    def create(
        cls,
        base: Path,
        accounts: Accounts,
        provider: InstalledProvider,
        slot_bytes: Sequence[int] = (SLOT_BYTES, SLOT_BYTES),
        **overrides: Any,
    ) -> Layout:
        """Two slot filesystems and the configuration; `overrides` replace Config fields."""
        filesystems = slot_filesystems(base, slot_bytes, SLOT_INODES)
        config = host_config(base, accounts, provider, filesystems, **overrides)
        return cls.write(base, config, filesystems)

    def provider_calls(self, method: str, attempt_id: str) -> int:
        """How many rows of `method` the provider has been called with for the attempt."""
        try:
            lines = (self.base / PROVIDER_CALLS).read_text().splitlines()
        except FileNotFoundError:
            return 0
        return lines.count(f"{method} {attempt_id}")

    def provider_batches(self, method: str) -> list[int]:
        """The row count of every driver call of `method`, in call order."""
        try:
            lines = (self.base / PROVIDER_BATCHES).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [int(rows) for name, rows in (line.split() for line in lines) if name == method]


def host_config(
    base: Path,
    accounts: Accounts,
    provider: InstalledProvider,
    filesystems: Sequence[SlotFilesystem],
    **overrides: Any,
) -> Config:
    """The suite's configuration for these slot filesystems (`slot0`, `slot1`, ...)."""
    resources = configs.allowance(
        cpu_millis=2000,
        memory_bytes=GIB,
        processes=512,
        slots=2,
        projects=[PROJECT],
        runtimes=["test"],
    )
    slots = [
        configs.slot(i, fs, accounts[f"slot{i}"], slot_class=SLOT_CLASS, storage_inodes=SLOT_INODES)
        for i, fs in enumerate(filesystems)
    ]
    return configs.host_config(
        base,
        transport=accounts["transport"],
        owners=[accounts["owner"]],
        slots=slots,
        resources=resources,
        providers=[provider_entry(provider.digest, base)],
        **overrides,
    )


class Daemon(Driver):
    """A daemon of the suite: its process, and requests bound to its configuration."""

    def __init__(self, layout: Layout, provider: InstalledProvider, accounts: Accounts) -> None:
        super().__init__(layout, accounts["transport"], accounts["owner"])
        self.layout: Layout = layout
        self.provider = provider
        self.accounts = accounts
        self.process = DaemonProcess.of(layout, provider)

    def start(self) -> None:
        """Start the daemon; return after READY=1."""
        self.process.start()

    def stop(self) -> int:
        """SIGTERM; its exit status."""
        return self.process.stop()

    def restart(self) -> None:
        """A clean stop (it must exit 0), then a new daemon on the same layout."""
        status = self.stop()
        assert status == 0, f"the daemon exited {status} on SIGTERM:\n{self.process.log()}"
        self.process = DaemonProcess.of(self.layout, self.provider)
        self.start()

    def plan(
        self,
        *,
        job_id: str | None = None,
        attempt_id: str | None = None,
        generation: int = 1,
        offer_revision: int = 1,
        inputs: Sequence[StreamedInput] = (),
        memory_bytes: int = 64 * MIB,
        slot_class: str = SLOT_CLASS,
    ) -> Plan:
        """A plan of `/bin/true` with the test provider (pinned as `provider` says: a
        test that re-pins it replaces `provider`) that fits one slot."""
        return self.make_plan(
            name="it-job",
            package_digest=self.provider.digest,
            job_id=job_id,
            attempt_id=attempt_id,
            generation=generation,
            offer_revision=offer_revision,
            slot_class=slot_class,
            image_digest=IMAGE,
            isolation="process",
            cpu_millis=500,
            memory_bytes=memory_bytes,
            processes=32,
            storage_bytes=32 * MIB,
            storage_inodes=1000,
            inputs=[i.object() for i in inputs],
        )
