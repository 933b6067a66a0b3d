"""The daemon under test as a process: started as the shipped unit runs it (its umask,
environment and limits) and stopped, or installed and run as the systemd service itself.

`DaemonProcess` starts `python -m ficc.execution serve` as a child process with
NOTIFY_SOCKET pointing at a datagram socket and returns once the daemon says READY=1
there (the way it tells systemd); it stops it with SIGTERM, kills it with SIGKILL,
freezes it with SIGSTOP, and reads its log. `UnitDaemon` is the same daemon as the
systemd service it ships as.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ficc_testkit.configs import Layout
from ficc_testkit.unit import UNIT, UnitSettings, shipped_settings, shipped_unit_file
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import InstalledProvider

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


class DaemonFailed(AssertionError):
    """The daemon exited, never became ready or did not stop; the message says which."""


class DaemonProcess:
    """`python -m ficc.execution serve` as a child process, ready when it says READY=1.

    The process gets what the shipped unit gives it (`settings`, read from the unit
    file: its umask, a clean environment, its limits, `python -I`, `/` as its working
    directory), never the test's own umask or environment. `run_dir` holds the notify
    socket (and the log, unless `log_path` is given); `python` is the interpreter whose
    installed ficc-executor-host runs; `environment` is added to the unit's;
    `new_session` puts the daemon in a session of its own (a terminal's Ctrl-C then
    reaches only the caller, which stops it).
    """

    def __init__(
        self,
        config_path: Path,
        provider_site: Path,
        *,
        run_dir: Path,
        log_path: Path | None = None,
        python: str = sys.executable,
        environment: Mapping[str, str] | None = None,
        new_session: bool = False,
        settings: UnitSettings | None = None,
    ) -> None:
        self.settings = settings or shipped_settings()
        self.config_path = config_path
        self.provider_site = provider_site
        self.python = python
        self.environment = dict(environment or {})
        self.new_session = new_session
        self.log_path = log_path or run_dir / f"daemon-{secrets.token_hex(3)}.log"
        self.notify_path = run_dir / "notify.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self._notify: socket.socket | None = None

    @classmethod
    def of(cls, layout: Layout, provider: InstalledProvider, **options: Any) -> DaemonProcess:
        """The daemon of `layout` with `provider` (its notify socket and log in its base)."""
        return cls(layout.config_path, provider.site, run_dir=layout.base, **options)

    def start(self) -> None:
        """Start the daemon and return once it said READY=1."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> int:
        """Start the daemon without waiting for it; its PID."""
        self.notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(self.notify_path))
        settings = self.settings
        notify_socket = {"NOTIFY_SOCKET": str(self.notify_path)}
        env = settings.process_environment({**self.environment, **notify_socket})
        command = settings.command(
            self.python, "serve", "--config", str(self.config_path),
            "--provider-path", str(self.provider_site),
        )  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd="/",
                umask=settings.umask,
                start_new_session=self.new_session,
            )
        self._notify = notify
        return self.process.pid

    def wait_ready(self) -> None:
        """Until READY=1 arrives; DaemonFailed if the daemon exits first or times out."""
        assert self.process is not None, "spawn() first"
        assert self._notify is not None, "spawn() first"
        with self._notify as notify:
            self._notify = None
            deadline = time.monotonic() + READY_TIMEOUT
            while time.monotonic() < deadline:
                readable, _, _ = select.select([notify], [], [], 0.2)
                if readable and "READY=1" in notify.recv(4096).decode(errors="replace").split("\n"):
                    return
                if self.process.poll() is not None:
                    raise DaemonFailed(
                        f"the daemon exited with status {self.process.returncode} before "
                        f"READY=1:\n{self.log()}"
                    )
        self.kill()
        raise DaemonFailed(f"no READY=1 within {READY_TIMEOUT:.0f} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        """The daemon's PID (it must have been started)."""
        assert self.process is not None, "not started"
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM and wait; the exit status (0 is a clean stop, and so is never started).
        A daemon that ignores SIGTERM is killed, and DaemonFailed raised."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DaemonFailed(
                f"the daemon ignored SIGTERM for {STOP_TIMEOUT:.0f} s:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL and reap (nothing if it is not running)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def freeze(self) -> None:
        """SIGSTOP: the daemon hangs, alive, until `thaw`."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after `freeze`."""
        os.kill(self.pid, signal.SIGCONT)

    @property
    def alive(self) -> bool:
        """Whether the daemon process is running."""
        return self.process is not None and self.process.poll() is None

    def log(self, tail: int = 200) -> str:
        """The last `tail` lines of the daemon's log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-tail:])

    def events(self) -> list[dict[str, Any]]:
        """Every structured (JSON) record of the log, in order."""
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
        return records


SYSTEMCTL = "/usr/bin/systemctl"
UNIT_DIR = Path("/etc/systemd/system")


def show_unit(unit: str, *keys: str) -> dict[str, str]:
    """`systemctl show` of the given properties, as a dict."""
    argv = [SYSTEMCTL, "show", unit, *(f"--property={k}" for k in keys)]
    output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


class UnitDaemon:
    """The daemon as the systemd service it ships as (needs systemd as PID 1).

    The shipped unit file (`unit_file`, else the one the installed
    ficc-executor-host wheel put under `share/`) is installed as is, plus a drop-in that only
    points it (its check-config and its serve) at this layout's configuration and
    provider, opens this layout's directories (and `read_write`) to it, and shortens
    the restart delay; `dropin` adds lines to the drop-in's [Service] section, and
    `shipped_dropins` are drop-in files a package ships, installed as they are
    (test.conf sorts after them, so it wins). The same interface as DaemonProcess:
    `start` returns after READY=1 (`systemctl start` waits for it), `kill` is a SIGKILL
    of the main process (after which the unit's Restart=on-failure brings a new daemon
    back: see `wait_restarted`), `stop` is `systemctl stop`.
    """

    def __init__(
        self,
        layout: Layout,
        provider: InstalledProvider,
        *,
        unit_file: Path | None = None,
        read_write: Sequence[str] = (),
        dropin: str = "",
        shipped_dropins: Sequence[Path] = (),
    ) -> None:
        self.layout = layout
        self.provider = provider
        self.pid = 0
        self.dropin_dir = UNIT_DIR / f"{UNIT}.d"
        shutil.copy(unit_file or shipped_unit_file(), UNIT_DIR / UNIT)
        self.dropin_dir.mkdir(exist_ok=True)
        for shipped in shipped_dropins:
            shutil.copy(shipped, self.dropin_dir / shipped.name)
        paths = " ".join([str(layout.base), "/sys/fs/cgroup", *read_write])
        (self.dropin_dir / "test.conf").write_text(
            "[Service]\n"
            "ExecStartPre=\n"
            f"ExecStartPre={sys.executable} -I -m ficc.execution check-config"
            f" --config {layout.config_path} --provider-path {provider.site}"
            " --allow-unavailable-providers\n"
            "ExecStart=\n"
            f"ExecStart={sys.executable} -I -m ficc.execution serve"
            f" --config {layout.config_path} --provider-path {provider.site}\n"
            # Reset first: the shipped /srv/ficc/slots does not exist here.
            "ReadWritePaths=\n"
            f"ReadWritePaths={paths}\n"
            "RestartSec=100ms\n" + dropin
        )
        self._systemctl("daemon-reload")
        self._systemctl("reset-failed", UNIT, check=False)

    @staticmethod
    def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SYSTEMCTL, *args], capture_output=True, text=True, check=check)

    def show(self, *keys: str) -> dict[str, str]:
        """`systemctl show` of the unit's properties `keys`."""
        return show_unit(UNIT, *keys)

    def start(self) -> None:
        """`systemctl start`, which returns after READY=1."""
        started = self._systemctl("start", UNIT, check=False)
        if started.returncode != 0:
            raise DaemonFailed(f"systemctl start {UNIT}: {started.stderr}\n{self.log()}")
        self.pid = int(self.show("MainPID")["MainPID"])

    def stop(self) -> int:
        """`systemctl stop`; 0 when the unit stopped cleanly (Result=success)."""
        self._systemctl("stop", UNIT, check=False)
        result = self.show("ActiveState", "Result")
        return 0 if result == {"ActiveState": "inactive", "Result": "success"} else 1

    def restart_cleanly(self) -> None:
        """`systemctl restart`: SIGTERM, a clean stop, then a new daemon up to READY=1."""
        old = self.pid
        restarted = self._systemctl("restart", UNIT, check=False)
        if restarted.returncode != 0:
            raise DaemonFailed(f"systemctl restart {UNIT}: {restarted.stderr}\n{self.log()}")
        self.pid = int(self.show("MainPID")["MainPID"])
        assert self.pid not in {0, old}, self.show("MainPID", "ActiveState")

    def kill(self) -> None:
        """SIGKILL the daemon's main process and wait until systemd has seen it die."""
        old = self.pid
        self._systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT, check=False)
        wait_for(lambda: self.show("MainPID")["MainPID"] != str(old), "systemd to see the kill")

    def wait_restarted(self) -> None:
        """Restart=on-failure at work: a new main process that said READY=1."""
        old = self.pid

        def running() -> bool:
            state = self.show("ActiveState", "SubState", "MainPID")
            return state["SubState"] == "running" and state["MainPID"] not in {"0", str(old)}

        wait_for(running, "systemd to restart the daemon", READY_TIMEOUT)
        self.pid = int(self.show("MainPID")["MainPID"])

    @property
    def alive(self) -> bool:
        """Whether the unit is active with the main process we know."""
        state = self.show("ActiveState", "MainPID")
        return state["ActiveState"] == "active" and state["MainPID"] == str(self.pid)

    def log(self, tail: int = 200) -> str:
        """The journal of the unit and the attempts' services."""
        argv = ["journalctl", "-u", UNIT, "-u", "ficc-work-*", "--no-pager", "-n", str(tail)]
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    def uninstall(self) -> None:
        """Stop the unit and remove it with its drop-in."""
        self._systemctl("stop", UNIT, check=False)
        self._systemctl("reset-failed", UNIT, check=False)
        shutil.rmtree(self.dropin_dir, ignore_errors=True)
        (UNIT_DIR / UNIT).unlink(missing_ok=True)
        self._systemctl("daemon-reload")
