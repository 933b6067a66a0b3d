"""A host of fakes for tests of the daemon's logic without root.

The real ledger (owned by this process, `ledger_support.create_ledger`), the test
kit's system service kept in memory, its slot files on plain directories and its
scripted provider driver, put together into a real `HostContext`, as the daemon's
composition root does with the real parts. The request handlers and the runner run
on it unchanged; what needs the kernel is proved by the root suites.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

from ficc.execution import protocol
from ficc.execution.host.api import handlers
from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.config.ceiling import initial_limits
from ficc.execution.host.config.model import Config, Slot
from ficc.execution.host.context.parts import HostContext, ProviderRuntime, SlotRuntime, Workers
from ficc.execution.host.linux.clock import BootClock
from ficc.execution.host.providers.loader import LoadedProvider
from ficc.execution.host.storage.staging import Stager
from ficc.execution.plan import Plan
from ficc.execution.protocol import Sender
from ficc_testkit import configs, plans
from ficc_testkit.accounts import Account
from ficc_testkit.driver import now_ms, renewal
from ficc_testkit.fakes import FakeService, FakeSlotFiles, RecordingRunner, ScriptedDriver
from ficc_testkit.plans import DIGEST, new_id
from ledger_support import create_ledger

SLOT_UID = 64_000
_NOT_READ: Any = None
"""The verified distribution of the loaded provider: the handlers never read it."""


def _config(base: Path) -> Config:
    resources = configs.allowance(
        cpu_millis=4000, memory_bytes=8 << 30, processes=512, slots=2,
        projects=["3" * 32], runtimes=["test"],
    )  # fmt: skip
    slots = [
        Slot(
            id=f"s{i}",
            slot_class="cpu",
            generation=1,
            path=str(base / f"slot{i}"),
            uid=SLOT_UID + i,
            gid=SLOT_UID + i,
            storage_bytes=1 << 30,
            storage_inodes=10_000,
            filesystem_uuid=f"0000000{i}-0000-4000-8000-000000000000",
        )
        for i in range(2)
    ]
    return configs.host_config(
        base, transport=Account("transport", 65_000, 65_000), slots=slots,
        resources=resources, providers=[configs.provider("test", DIGEST)],
        deployment_id="1" * 32, node_id="2" * 32,
    )  # fmt: skip


class Host:
    """A `HostContext` of the real ledger and the fakes, and a way to send it requests.

    `runner` is what the handlers hand their decisions to: a `RecordingRunner` unless
    the test gives its own (a real `Runner` over this context)."""

    def __init__(self, base: Path) -> None:
        self.config = config = _config(base)
        state = base / "state"
        state.mkdir(mode=0o700)
        for slot in config.slots:
            Path(slot.path).mkdir(mode=0o755)
        ledger = create_ledger(
            state, config.installation_id, initial_limits(config), initial_limits(config)
        )
        self.driver = ScriptedDriver()
        loaded = LoadedProvider("test", _NOT_READ, types.ModuleType("test"), self.driver)
        self.service = FakeService()
        self.files = {s.id: FakeSlotFiles(Path(s.path)) for s in config.slots}
        self.runner: RunnerPort = RecordingRunner()
        self.ctx = HostContext(
            config=config,
            ledger=ledger,
            clock=BootClock(),
            slots={
                s.id: SlotRuntime(
                    s.id,
                    s.slot_class,
                    s.path,
                    s.uid,
                    s.gid,
                    s.storage_bytes,
                    s.storage_inodes,
                    s.filesystem_uuid,
                    Stager(s.path, s.gid),
                    self.files[s.id],
                )
                for s in config.slots
            },
            providers={"test": ProviderRuntime("test", DIGEST, loaded, None)},
            service=self.service,
            workers=Workers(),
        )

    async def ask(self, request: protocol.Request, sender: Sender = Sender.TRANSPORT) -> Any:
        """The handlers' reply to `request`, in the running event loop."""
        return await handlers.handle(self.ctx, self.runner, sender, request)

    def send(self, request: protocol.Request, sender: Sender = Sender.TRANSPORT) -> Any:
        """`ask`, in an event loop of its own."""
        return asyncio.run(self.ask(request, sender))

    def prepare_request(self, *plans_: Plan, lease_ms: int = 300_000, **bindings: Any) -> Any:
        """A prepare of `plans_` with leases `lease_ms` from now."""
        expires = now_ms() + lease_ms
        attempts = [protocol.PrepareAttempt(plan=p, lease=renewal(p, 1, expires)) for p in plans_]
        return protocol.PrepareRequest(
            version=1, id=new_id(), **(self.bindings() | bindings), attempts=attempts
        )

    def bindings(self) -> dict[str, Any]:
        b = self.ctx.ledger.bindings()
        return {"installation_id": b.installation_id, "ledger_id": b.ledger_id,
                "admission_version": b.admission_version}  # fmt: skip

    def prepare(self, *plans_: Plan, **bindings: Any) -> list[Any]:
        return list(self.send(self.prepare_request(*plans_, **bindings)).results)

    def close(self) -> None:
        self.ctx.workers.shutdown()
        self.ctx.ledger.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def plan(**fields: Any) -> Plan:
    """A plan for this host (its deployment and node)."""
    return plans.make_plan(deployment_id="1" * 32, node_id="2" * 32, **fields)
