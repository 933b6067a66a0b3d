"""The whole demo run, in order; `main()` is what `python tools/demo.py` calls.

1. check the machine          root, podman, runc, a C compiler, busybox-static
2. accounts                   ficc-demo-transport (the controller's transport) and
                              ficc-demo-slot (the job runs as it), created if missing
3. the previous run           stopped and removed if something is left of it
4. wheels and the provider    four wheels built by hatchling; the provider installed
                              into a root-owned prefix and pinned by its digest
5. the test image             static busybox -> OCI archive, no registry
6. the configuration          root 0600 JSON, checked by the daemon's own parser first
7. the daemon                 started as a child process, ready on READY=1
8. the job                    every protocol step as the transport account
9. status and stop            `python -m ficc.execution status`, SIGTERM, no leftovers

Exit status 0 when the job succeeded end to end and nothing was left running, 1
otherwise (with the reason and the tail of the daemon's log), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from demo import config, host, job, report
from demo.controller import Result, Target, as_account
from demo.daemon import DaemonFailed, DaemonProcess
from demo.layout import DEFAULT_BASE, SLOT_ACCOUNT, TRANSPORT_ACCOUNT, RunLayout
from ficc.execution.host.cli import provision
from ficc.execution.host.config.load import parse_config
from ficc.execution.host.core.errors import HostError
from ficc_testkit.accounts import Account
from ficc_testkit.plans import new_id

PHASES = 10


class Demo:
    """State shared by the phases of one run."""

    def __init__(self, base: Path) -> None:
        self.base = base
        name = time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
        self.layout = RunLayout(base / name)
        self.daemon: DaemonProcess | None = None
        self.ids = config.Identities()
        self.phase_number = 0

    @contextmanager
    def phase(self, title: str) -> Iterator[None]:
        self.phase_number += 1
        print(f"\n== {self.phase_number}/{PHASES} {title}", flush=True)
        started = time.monotonic()
        yield
        print(f"   ({time.monotonic() - started:.1f} s)", flush=True)

    def say(self, text: str) -> None:
        print(f"   {text}", flush=True)

    # --- the phases ------------------------------------------------------------------------

    def run(self) -> None:
        with self.phase("check the machine"):
            found = host.check_machine()
            self.say(f"root, {', '.join(found)}: present")
        with self.phase("accounts"):
            self.transport = self.account(TRANSPORT_ACCOUNT, "the controller's transport")
            self.slot = self.account(SLOT_ACCOUNT, "runs the job (rootless Podman)")
        with self.phase("the previous run"):
            done = host.clean_previous_runs(self.base, self.slot)
            for line in done or ["nothing to clean"]:
                self.say(line)
            host.make_directories(self.layout, self.transport)
            self.say(f"this run: {self.layout.root}")
        with self.phase("the slot filesystem"):
            self.slot_fs = host.make_slot(self.layout)
            self.say(
                f"{self.layout.slot_image} (ext4, allocated in full) mounted nodev,nosuid on "
                f"{self.layout.slot_dir}"
            )
            self.say(f"filesystem UUID {self.slot_fs.filesystem_uuid} (the slot is bound to it)")
        with self.phase("wheels and the pinned provider"):
            wheels = host.build_wheels(self.layout)
            for wheel in wheels.values():
                self.say(f"built {wheel.name}")
            self.site = host.install_provider(self.layout, wheels[host.PROVIDER_PACKAGE])
            self.say(f"provider installed (not editable) in {self.site}")
            self.digest = host.provider_digest(self.site)
            self.say(f"pin (provider-digest podman): {self.digest}")
        with self.phase("the test image"):
            self.image = host.build_image(self.layout)
            self.say(f"archive  {self.image.archive}")
            self.say(f"sha256   {self.image.archive_sha256}")
            self.say(f"image id {self.image.image_id}")
        with self.phase("the administrator's configuration"):
            document = config.admin_config(
                self.layout,
                self.ids,
                transport=self.transport,
                slot=self.slot,
                provider_digest=self.digest,
                image=self.image,
                filesystem_uuid=self.slot_fs.filesystem_uuid,
            )
            parse_config(json.dumps(document).encode(), ".json")  # the daemon's own rules
            host.write_config(self.layout, document)
            self.say(f"{self.layout.config_file} (root, 0600)")
            self.say(
                f"slot {self.layout.slot_dir} as {self.slot.name}; transport "
                f"{self.transport.name}; offer active"
            )
        with self.phase("the daemon"):
            self.daemon = DaemonProcess(self.layout, self.site)
            seconds = self.daemon.start()
            self.say(f"python -m ficc.execution serve --config {self.layout.config_file}")
            self.say(f"pid {self.daemon.pid}, READY=1 after {seconds:.1f} s")
            self.say(f"log {self.layout.daemon_log}")
        with self.phase(f"the job, as {self.transport.name} over {self.layout.transport_socket}"):
            result = self.job()
        self.show(result)
        if not result.ok:
            raise JobError(result.error)
        with self.phase("status and stop"):
            self.status()
            self.stop()

    def account(self, name: str, role: str) -> Account:
        account, created = host.ensure_account(name)
        verb = "created" if created else "exists"
        self.say(f"{name:<20} uid {account.uid:<6} {verb:<8} {role}")
        return account

    def job(self) -> Result:
        ids = job.JobIds(new_id(), new_id(), new_id())
        target = Target(
            socket=str(self.layout.transport_socket),
            out_dir=str(self.layout.controller_dir),
            deployment_id=self.ids.deployment_id,
            node_id=self.ids.node_id,
            image_id=self.image.image_id,
            ids=ids,
        )
        self.attempt_id = ids.attempt_id
        return as_account(self.transport, target)

    def show(self, result: Result) -> None:
        steps = [report.Step(**s) for s in result.steps]
        if steps:
            print("\nsummary", flush=True)
            print(report.summary(steps), flush=True)
        for name, title in (
            ("stdout", "the payload's stdout"),
            (f"output:{job.OUTPUT_NAME}", f"the declared output {job.OUTPUT_NAME!r}"),
        ):
            if name in result.collected:
                print(f"\n{title} (collected through the protocol):", flush=True)
                print(report.indented(result.collected[name]), flush=True)
        stderr = result.collected.get("stderr", "")
        if stderr.strip():
            print("\nthe payload's stderr:", flush=True)
            print(report.indented(stderr), flush=True)

    def status(self) -> None:
        command = [sys.executable, "-m", "ficc.execution", "status"]
        result = subprocess.run(
            [*command, "--config", str(self.layout.config_file)],
            capture_output=True,
            text=True,
            check=False,
        )
        self.say("python -m ficc.execution status --config ...")
        print(report.indented(result.stdout + result.stderr, "   | "), flush=True)

    def stop(self) -> None:
        """Stop the daemon and prove nothing of the run is still running."""
        if self.daemon is None:
            return
        daemon, self.daemon = self.daemon, None
        status = daemon.stop()
        if status not in (0, None):
            raise DaemonFailed(f"the daemon exited with status {status} on SIGTERM")
        self.say(f"daemon stopped (exit status {status})")
        left = host.processes_of(self.slot.uid)
        if left:
            killed = host.kill_processes_of(self.slot.uid)
            raise DaemonFailed(
                f"{killed} process(es) of {self.slot.name} were still running after the "
                "attempt was released; the demo killed them"
            )
        self.say(f"no process of {self.slot.name} is running")
        services = host.services_of(self.ids.installation_id)
        if services:
            host.remove_services(self.ids.installation_id)
            raise DaemonFailed(
                f"the attempt's service was still there after release ({', '.join(services)});"
                " the demo removed it"
            )
        self.say("no attempt service (cgroup) of this installation is left")
        provision.remove_slot(str(self.layout.slot_dir))
        self.say(f"slot filesystem unmounted (its image stays: {self.layout.slot_image})")

    def emergency_stop(self) -> None:
        """After a failure: never leave a daemon or a payload running."""
        if self.daemon is None and getattr(self, "slot", None) is None:
            print("   nothing was started", flush=True)
            return
        if self.daemon is not None:
            daemon, self.daemon = self.daemon, None
            try:
                status = daemon.stop()
                print(f"   daemon stopped (exit status {status})", flush=True)
            except DaemonFailed as exc:
                print(f"   {exc}", flush=True)
        slot = getattr(self, "slot", None)
        if slot is not None:
            killed = host.kill_processes_of(slot.uid)
            if killed:
                print(f"   killed {killed} leftover process(es) of {slot.name}", flush=True)
            removed = host.remove_services(self.ids.installation_id)
            if removed:
                print(f"   removed {removed} leftover attempt service(s)", flush=True)
        if os.path.ismount(self.layout.slot_dir):
            provision.remove_slot(str(self.layout.slot_dir))
            print(f"   slot filesystem {self.layout.slot_dir} unmounted", flush=True)


class JobError(Exception):
    """The job did not succeed end to end (the controller already said why)."""


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/demo.py",
        description="One real job through the ficc executor host and the Podman provider.",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=DEFAULT_BASE,
        help=f"where the run directory goes (default {DEFAULT_BASE}; root-owned, not /tmp)",
    )
    args = parser.parse_args(argv)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: stop cleanly
        signal.signal(signum, _interrupt)
    demo = Demo(args.base)
    print("ficc demo: one real job through the executor host daemon and the Podman provider")
    print(f"run directory {demo.layout.root} (kept afterwards for inspection)", flush=True)
    failure: str | None = None
    try:
        demo.run()
    except KeyboardInterrupt:
        failure = "interrupted"
    except (host.SetupFailed, DaemonFailed) as exc:
        failure = str(exc)
    except HostError as exc:  # the daemon's own configuration check refused
        failure = f"{exc.code}: {exc.message}"
    except JobError as exc:
        failure = f"the job did not succeed: {exc}"
    finally:
        if failure is not None or demo.daemon is not None:
            print("\n== stopping after a failure", flush=True)
            demo.emergency_stop()
    return finish(demo, failure)


def finish(demo: Demo, failure: str | None) -> int:
    layout = demo.layout
    if failure is not None:
        print(f"\nDEMO FAILED: {failure}", file=sys.stderr, flush=True)
        if layout.daemon_log.exists():
            tail = DaemonProcess(layout, Path()).log_tail()
            print(f"\nlast lines of the daemon log ({layout.daemon_log}):", file=sys.stderr)
            print(tail, file=sys.stderr, flush=True)
        if layout.root.exists():
            print(f"\neverything of this run is in {layout.root}", file=sys.stderr)
        return 130 if failure == "interrupted" else 1
    print("\nthe job ran end to end. Everything of this run is kept for inspection:")
    for label, path in (
        ("configuration", layout.config_file),
        ("daemon log", layout.daemon_log),
        ("ledger", layout.state_dir),
        ("controller", layout.controller_dir),
        ("slot image", layout.slot_image),
    ):
        print(f"  {label:<14}{path}")
    print("the next run removes it first.")
    return 0
