"""What both service backends' behaviour tests share: the programs the tests run as
the slot account, and small helpers that read the live result.

Kept in one place so the cgroupfs suite (test_service_cgroupfs.py) and the suite
parametrized over both backends (test_service_systemd.py, also run under real systemd
by tools/systemd/run.py, which copies this module next to it) test the same things.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ficc.execution.host.service import DeviceRule, ServiceHandle

PYTHON = "/usr/bin/python3"
SOAK = os.environ.get("FICC_SOAK") == "1"
NULL = DeviceRule("/dev/null", 1, 3)
SLEEPERS = ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & wait"]


def wait_for(condition: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll a condition with a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)


def py(code: str) -> list[str]:
    return [PYTHON, "-I", "-S", "-c", code]


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def all_nodes_gone(handle: ServiceHandle) -> bool:
    return not any(os.path.exists(p) for p in handle.cgroups.values())


# Tries 20 forks; prints how many succeeded and how many the pids limit refused.
FORKER = """
import json, os
r, w = os.pipe()
ok = failed = 0
for _ in range(20):
    try:
        pid = os.fork()
    except BlockingIOError:
        failed += 1
        continue
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    ok += 1
os.write(1, json.dumps({"ok": ok, "failed": failed}).encode())
os.close(w)
for _ in range(ok):
    os.wait()
"""


# Opens /dev/null and /dev/zero; prints what the device policy allowed.
OPENER = """
import json, os
result = {}
for name, flags in (("null", os.O_WRONLY), ("zero", os.O_RDONLY)):
    try:
        os.close(os.open("/dev/" + name, flags))
        result[name] = "ok"
    except OSError as error:
        result[name] = __import__("errno").errorcode[error.errno]
os.write(1, json.dumps(result).encode())
"""


# Double-forks a setsid grandchild (prints its PID) that outlives its parent.
DAEMONIZER = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(1, b"%d\\n" % os.getpid())
        time.sleep(1000)
    os._exit(0)
os.wait()
time.sleep(1000)
"""
