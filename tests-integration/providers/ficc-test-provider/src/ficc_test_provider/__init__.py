"""TEST ONLY: an unconfined ficc executor provider.

Its runtime is a plain child process of whoever calls `start` -- no namespaces, no
seccomp, no dropped capabilities -- so the host's payload gate must refuse it. It
exists to exercise provider pinning, loading and batch calls against a real installed
distribution. Never install it on a real host.

Every driver method takes a list of 1..64 context dicts and returns one dict per
context, in order, as the host's provider interface requires.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

API_VERSION = 1

_MARKER_VARIABLE = "FICC_TEST_PROVIDER_IMPORT_MARKER"

# A module-level side effect, on purpose: tests use it as a positive control that
# importing this module runs code (so "no marker" proves "nothing was imported").
if os.environ.get(_MARKER_VARIABLE):
    with open(os.environ[_MARKER_VARIABLE], "w", encoding="utf-8") as _marker:
        _marker.write("imported\n")

Context = dict[str, Any]
Reply = dict[str, Any]


def configure(configuration: dict[str, Any]) -> Driver:
    """Build a driver; `argv` comes from administrator configuration, never a request."""
    argv = configuration.get("argv", ["/bin/true"])
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("configuration 'argv' must be a non-empty list of strings")
    return Driver(list(argv))


def _attempt(context: Context) -> str:
    attempt = context["attempt_id"]
    if not isinstance(attempt, str):
        raise TypeError("context 'attempt_id' must be a string")
    return attempt


class Driver:
    """The seven batch methods; children are tracked by attempt ID."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def _each(self, contexts: list[Context], row: Callable[[Context], Reply]) -> list[Reply]:
        return [row(context) for context in contexts]

    def probe(self, contexts: list[Context]) -> list[Reply]:
        return self._each(contexts, lambda _: {"ok": True, "runtime": "unconfined-process"})

    def prepare(self, contexts: list[Context]) -> list[Reply]:
        def row(context: Context) -> Reply:
            context["check"]()  # lease and local authority, before preparation
            return {
                "argv": list(self.argv),
                "barrier": self.argv[0],
                "devices": [],
                "mounts": [],
                "generated_targets": [],
                "positive_devices": [],
                "negative_devices": [],
            }

        return self._each(contexts, row)

    def start(self, contexts: list[Context]) -> list[Reply]:
        def row(context: Context) -> Reply:
            attempt = _attempt(context)
            if attempt not in self.children:
                self.children[attempt] = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, start_new_session=True
                )
            return {"started": True, "pid": self.children[attempt].pid}

        return self._each(contexts, row)

    def observe(self, contexts: list[Context]) -> list[Reply]:
        def row(context: Context) -> Reply:
            child = self.children.get(_attempt(context))
            if child is None:
                return {"phase": "waiting"}
            status = child.poll()
            if status is None:
                return {"phase": "payload", "pid": child.pid}
            return {"phase": "finished", "exit_code": status if status >= 0 else 128 - status}

        return self._each(contexts, row)

    def stop(self, contexts: list[Context]) -> list[Reply]:
        def row(context: Context) -> Reply:
            child = self.children.get(_attempt(context))
            if child is not None and child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            return {"stopped": True}

        return self._each(contexts, row)

    def collect(self, contexts: list[Context]) -> list[Reply]:
        return self._each(contexts, lambda _: {"ok": True})

    def release(self, contexts: list[Context]) -> list[Reply]:
        def row(context: Context) -> Reply:
            child = self.children.pop(_attempt(context), None)
            if child is not None and child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            return {"released": True}

        return self._each(contexts, row)
