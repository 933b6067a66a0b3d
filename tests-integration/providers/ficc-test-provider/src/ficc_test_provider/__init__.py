"""TEST ONLY: an unconfined ficc executor provider.

Its runtime is a plain child process of whoever calls `start` -- no namespaces, no
seccomp, no dropped capabilities -- so the host's payload gate must refuse it. It
exists to exercise provider pinning, loading and batch calls against a real installed
distribution. Never install it on a real host.

Every driver method takes a list of 1..64 contexts (the provider SDK's `Context`,
`PrepareContext` for prepare) and returns one dict per context, in order, built from
the SDK's reply Structs, as the host's provider interface requires.

Two runtimes, chosen by the administrator configuration (`runtime`):

- `child` (default): `start` runs `argv` as a plain child of the caller.
- `service`: the host runs the prepare result's argv in the attempt's system service
  (as the slot account). That argv is a shell "barrier" (`/bin/sh`, resolved): it
  tries to open every positive and negative device, reports the results and its PID
  in a status directory below the attempt's storage, waits for the host's release
  marker, then runs the plan's payload argv and reports its exit code. `observe`
  reads those reports: `ready` with the device-open results, `payload` with the
  barrier's host PID, `finished` with the exit code. Nothing in it is confined, so
  the payload gate must refuse it.

If `call_log` names a file, every row of every driver call appends one line
`<method> <attempt_id>` to it, so tests can count calls (e.g. "start never again").
If `batch_log` names a file, every driver call appends one line `<method> <rows>`,
so tests can see how the host grouped rows into calls.
If `context_log` names a file, every row also appends one JSON line
`{"method": ..., "context": ...}` with the context as received, as plain data (a
callable, such as prepare's `check`, is written as the string "<callable>").

What it offers (each optional): `images`, `isolations` and `networks` list the
image digests, isolations and networks probe accepts; it refuses any other with
`image_unknown`, `isolation_unsupported` or `network_unsupported`, as a real provider
refuses what it does not offer.

`minimum_limits` (an object) is what the driver's `minimum_limits()` states, passed
through unchecked so a test can also give one the SDK would not build; without it the
driver states nothing (`{}`).

If `verified_storage` is true, probe, prepare and start refuse a row whose storage
binding is not verified (`storage_unverified`), as a provider may that relies on the
documented contract (the binding is verified in those three).

Deliberate defects (`defects`, a list; TEST ONLY, to show the conformance kit
failing): `prepare_ignores_check` (prepare goes on when check() refuses) and
`release_not_idempotent` (a second release of an attempt is refused).

Failures a plan can ask for through its payload environment (TEST ONLY):
`FICC_TEST_PROVIDER_PROBE=fail` makes probe answer `ok: false`;
`FICC_TEST_PROVIDER_MALFORMED=<method>` (probe, start or release) makes that method
answer a reply the SDK would not build (`{"<field>": "yes"}`);
`FICC_TEST_PROVIDER_HANG=<method>:<seconds>` makes that method's row block for that
long before answering, standing in for a hung provider (`<method>:hold`: until the test
creates `go-<method>` in the attempt's storage; the row creates `held-<method>` there
first);
`FICC_TEST_PROVIDER_READY_PID=1` makes observe report the barrier's PID in `ready`
(as the Podman provider does) and never report `payload`;
`FICC_TEST_PROVIDER_LATE=1` holds one observe reply that found no exit report until the
test lets it answer (see LATE_VARIABLE);
`FICC_TEST_PROVIDER_ORPHAN=1` makes prepare leave a process of the slot account
running outside any service (`sleep`, in a session of its own, its PID in `orphan.pid`
in the attempt's storage), as a rootless Podman command leaves its pause process or as
a provider command outlives a daemon that died.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from ficc.execution import provider as sdk

API_VERSION = 1

_MARKER_VARIABLE = "FICC_TEST_PROVIDER_IMPORT_MARKER"

# A module-level side effect, on purpose: tests use it as a positive control that
# importing this module runs code (so "no marker" proves "nothing was imported").
if os.environ.get(_MARKER_VARIABLE):
    with open(os.environ[_MARKER_VARIABLE], "w", encoding="utf-8") as _marker:
        _marker.write("imported\n")

Context = sdk.Context
Reply = sdk.Reply
_C = TypeVar("_C", bound=sdk.Context)


def configure(configuration: dict[str, Any]) -> Driver:
    """Build a driver; `argv` comes from administrator configuration, never a request."""
    argv = configuration.get("argv", ["/bin/true"])
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("configuration 'argv' must be a non-empty list of strings")
    runtime = configuration.get("runtime", "child")
    if runtime not in ("child", "service"):
        raise ValueError("configuration 'runtime' must be 'child' or 'service'")
    devices = configuration.get("devices", {})
    negative = configuration.get("negative_devices", [])
    call_log = configuration.get("call_log")
    context_log = configuration.get("context_log")
    if context_log is not None and not isinstance(context_log, str):
        raise ValueError("configuration 'context_log' must be a path")
    batch_log = configuration.get("batch_log")
    if batch_log is not None and not isinstance(batch_log, str):
        raise ValueError("configuration 'batch_log' must be a path")
    if not isinstance(devices, dict) or not all(
        isinstance(k, str) and _node_paths(v) for k, v in devices.items()
    ):
        raise ValueError("configuration 'devices' must map device names to node paths")
    if not isinstance(negative, list) or not all(isinstance(p, str) for p in negative):
        raise ValueError("configuration 'negative_devices' must be a list of paths")
    if call_log is not None and not isinstance(call_log, str):
        raise ValueError("configuration 'call_log' must be a path")
    offer = {key: configuration.get(key) for key in ("images", "isolations", "networks")}
    for key, value in offer.items():
        if value is not None and (
            not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        ):
            raise ValueError(f"configuration {key!r} must be a list of strings")
    verified_storage = configuration.get("verified_storage", False)
    if not isinstance(verified_storage, bool):
        raise ValueError("configuration 'verified_storage' must be true or false")
    defects = configuration.get("defects", [])
    if not isinstance(defects, list) or not set(defects) <= DEFECTS:
        raise ValueError(f"configuration 'defects' must be a list of {sorted(DEFECTS)}")
    if runtime == "service":
        nodes = {name: _node_paths(paths) for name, paths in devices.items()}
        driver: Driver = ServiceDriver(list(argv), nodes, list(negative), call_log)
    else:
        driver = Driver(list(argv), call_log)
    driver.context_log = context_log
    driver.offer = {k: frozenset(v) for k, v in offer.items() if v is not None}
    driver.defects = frozenset(defects)
    driver.verified_storage = verified_storage
    driver.batch_log = batch_log
    driver.minimums = configuration.get("minimum_limits", {})
    return driver


def _node_paths(value: object) -> list[str]:
    """A device's nodes: one path, or a list of them (a bundle: its own nodes and the
    ones its kind shares); empty when `value` is neither."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return list(value)
    return []


def main() -> int:
    """Console script: says what this distribution is, and nothing else."""
    print("ficc-test-provider: TEST ONLY, unconfined; never install on a real host")
    return 0


def _attempt(context: Context) -> str:
    return context.attempt_id


DEFECTS = frozenset({"prepare_ignores_check", "release_not_idempotent"})
PROBE_VARIABLE = "FICC_TEST_PROVIDER_PROBE"
MALFORMED_VARIABLE = "FICC_TEST_PROVIDER_MALFORMED"
_MALFORMED = {"probe": {"ok": "yes"}, "start": {"started": "yes"}, "release": {"released": "yes"}}
HANG_VARIABLE = "FICC_TEST_PROVIDER_HANG"
HOLD_WAIT = 60.0
READY_PID_VARIABLE = "FICC_TEST_PROVIDER_READY_PID"
ORPHAN_VARIABLE = "FICC_TEST_PROVIDER_ORPHAN"
ORPHAN_PID_FILE = "orphan.pid"


def _environment(context: Context) -> dict[str, str]:
    return dict(context.plan.job.payload.environment)


def _malformed(method: str, context: Context) -> Reply | None:
    """The malformed reply the plan asks `method` for, if it asks."""
    if _environment(context).get(MALFORMED_VARIABLE) == method:
        return dict(_MALFORMED[method])
    return None


def _hang(method: str, contexts: Sequence[Context]) -> None:
    """Block as long as a row's plan asks this method to hang (the longest of them), or,
    for `<method>:hold`, until the test lets each held row go (`_hold`)."""
    longest = 0.0
    for context in contexts:
        wanted, _, seconds = _environment(context).get(HANG_VARIABLE, "").partition(":")
        if wanted == method and seconds == "hold":
            _hold(method, context)
        elif wanted == method:
            longest = max(longest, float(seconds or 0))
    if longest:
        time.sleep(longest)


def _hold(method: str, context: Context) -> None:
    """Create `held-<method>` in the attempt's storage, then wait (at most HOLD_WAIT)
    until the test creates `go-<method>` there."""
    storage = context.storage.path
    with open(os.path.join(storage, f"held-{method}"), "w", encoding="utf-8"):
        pass
    deadline = time.monotonic() + HOLD_WAIT
    while not os.path.exists(os.path.join(storage, f"go-{method}")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test never let the held {method} go")
        time.sleep(0.01)


def _leave_orphan(context: Context) -> None:
    """A process of the slot account outside any service, left running (ORPHAN_VARIABLE)."""
    if _environment(context).get(ORPHAN_VARIABLE) != "1":
        return
    child = subprocess.Popen(
        ["/bin/sleep", "3600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        user=context.slot.uid,
        group=context.slot.gid,
        extra_groups=[],
        start_new_session=True,
        cwd="/",
    )
    with open(os.path.join(context.storage.path, ORPHAN_PID_FILE), "w", encoding="ascii") as out:
        out.write(str(child.pid))


def _loggable(context: Context) -> Any:
    return msgspec.to_builtins(context, enc_hook=lambda value: "<callable>")


class Driver:
    """The seven batch methods; children are tracked by attempt ID."""

    def __init__(self, argv: list[str], call_log: str | None = None) -> None:
        self.argv = argv
        self.call_log = call_log
        self.context_log: str | None = None
        self.offer: dict[str, frozenset[str]] = {}
        self.defects: frozenset[str] = frozenset()
        self.verified_storage = False
        self.released: set[str] = set()
        self.batch_log: str | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.minimums: object = {}

    def minimum_limits(self) -> Any:
        """What the configuration's `minimum_limits` states (see the module docstring)."""
        return self.minimums

    def _each(self, contexts: Sequence[_C], row: Callable[[_C], Reply]) -> list[Reply]:
        return [row(context) for context in contexts]

    def _logged(self, method: str, contexts: Sequence[Context]) -> None:
        if self.batch_log is not None:
            with open(self.batch_log, "a", encoding="utf-8") as log:
                log.write(f"{method} {len(contexts)}\n")
        if self.context_log is not None:
            with open(self.context_log, "a", encoding="utf-8") as log:
                for context in contexts:
                    record = {"method": method, "context": _loggable(context)}
                    log.write(json.dumps(record, sort_keys=True) + "\n")
        if self.call_log is not None:
            with open(self.call_log, "a", encoding="utf-8") as log:
                for context in contexts:
                    log.write(f"{method} {context.attempt_id}\n")
        _hang(method, contexts)

    def _unverified(self, context: Context) -> Reply | None:
        """With `verified_storage`, the refusal of a row whose binding is not verified."""
        if self.verified_storage and not context.storage.verified:
            return sdk.refusal("storage_unverified", f"{context.storage.path} is not verified")
        return None

    def _check(self, context: sdk.PrepareContext) -> Reply | None:
        """check() before preparing: its refusal as the row's, unless a defect ignores it
        (after the storage binding's check, when one is asked for)."""
        unverified = self._unverified(context)
        if unverified is not None:
            return unverified
        try:
            context.check()
        except sdk.Refused as error:
            if "prepare_ignores_check" not in self.defects:
                return sdk.refusal(error.code, error.message)
        return None

    def _release(self, context: Context) -> Reply:
        malformed = _malformed("release", context)
        if malformed is not None:
            return malformed
        if "release_not_idempotent" in self.defects:
            if context.attempt_id in self.released:
                return sdk.refusal("not_prepared", "this attempt was released already")
            self.released.add(context.attempt_id)
        return sdk.reply(sdk.ReleaseReply(released=True))

    def probe(self, contexts: list[Context]) -> list[Reply]:
        self._logged("probe", contexts)

        def row(context: Context) -> Reply:
            unverified = self._unverified(context)
            if unverified is not None:
                return unverified
            if _environment(context).get(PROBE_VARIABLE) == "fail":
                return sdk.reply(sdk.ProbeReply(ok=False))
            malformed = _malformed("probe", context)
            if malformed is not None:
                return malformed
            runtime = context.plan.job.runtime
            for key, value, code in (
                ("images", runtime.image_digest, "image_unknown"),
                ("isolations", runtime.isolation, "isolation_unsupported"),
                ("networks", runtime.network, "network_unsupported"),
            ):
                if key in self.offer and value not in self.offer[key]:
                    return sdk.refusal(code, f"{value!r} is not offered ({key})")
            return sdk.reply(sdk.ProbeReply(ok=True))

        return self._each(contexts, row)

    def prepare(self, contexts: list[sdk.PrepareContext]) -> list[Reply]:
        self._logged("prepare", contexts)

        def row(context: sdk.PrepareContext) -> Reply:
            refused = self._check(context)  # lease and local authority, before preparing
            if refused is not None:
                return refused
            _leave_orphan(context)
            found = os.stat(self.argv[0])
            identity = sdk.Identity(device=found.st_dev, inode=found.st_ino)
            result = sdk.PrepareResult(
                argv=list(self.argv),
                barrier=sdk.BarrierSpec(path=self.argv[0], identity=identity),
                devices=[],
                mounts=[],
                generated_targets=[],
                positive_devices=[],
                negative_devices=[],
            )
            return sdk.reply(result)

        return self._each(contexts, row)

    def start(self, contexts: list[Context]) -> list[Reply]:
        self._logged("start", contexts)

        def row(context: Context) -> Reply:
            unverified = self._unverified(context)
            if unverified is not None:
                return unverified
            attempt = _attempt(context)
            if attempt not in self.children:
                self.children[attempt] = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, start_new_session=True
                )
            return {**sdk.reply(sdk.StartReply(started=True)), "pid": self.children[attempt].pid}

        return self._each(contexts, row)

    def observe(self, contexts: list[Context]) -> list[Reply]:
        self._logged("observe", contexts)

        def row(context: Context) -> Reply:
            child = self.children.get(_attempt(context))
            if child is None:
                return sdk.reply(sdk.Observation(phase="waiting"))
            status = child.poll()
            if status is None:
                return sdk.reply(sdk.Observation(phase="payload", pid=child.pid))
            code = status if status >= 0 else 128 - status
            return sdk.reply(sdk.Observation(phase="finished", exit_code=code))

        return self._each(contexts, row)

    def stop(self, contexts: list[Context]) -> list[Reply]:
        self._logged("stop", contexts)

        def row(context: Context) -> Reply:
            child = self.children.get(_attempt(context))
            if child is not None and child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            return sdk.reply(sdk.StopReply(stopped=True))

        return self._each(contexts, row)

    def collect(self, contexts: list[Context]) -> list[Reply]:
        self._logged("collect", contexts)
        return self._each(contexts, lambda _: sdk.reply(sdk.CollectReply(ok=True)))

    def release(self, contexts: list[Context]) -> list[Reply]:
        self._logged("release", contexts)

        def row(context: Context) -> Reply:
            child = self.children.pop(_attempt(context), None)
            if child is not None and child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            return self._release(context)

        return self._each(contexts, row)


# The barrier of the `service` runtime, run by /bin/sh as the slot account:
#   $1 release marker, $2 status directory, $3 hold (1: report no PID until a file
#   `go` appears in the status directory, so tests can keep an attempt `starting`;
#   fail: print a runtime's refusal on stderr and exit before the release, as a
#   runtime that cannot create the container does; oom: grow until the kernel's
#   out-of-memory killer kills it before the release, as a runtime given too little
#   memory for itself is),
#   then N, N positive devices, M, M negative devices, then the payload argv.
#   Device results are "1 PATH" (opened) or "0 PATH" (refused). A hold ending in
#   "+teardown" or "+stuck" stands in for a runtime's own teardown after the exit is
#   reported: one second, then `torn-down` in the status directory; or forever.
BARRIER_SCRIPT = """\
marker=$1 status=$2 hold=${3%%+*} after=${3#"${3%%+*}"}
shift 3
if [ "$hold" = fail ]; then
  echo "ficc-test-barrier: preparing the runtime" >&2
  echo "ficc-test-barrier: OCI runtime error: the runtime refused to create the container" >&2
  exit 125
fi
if [ "$hold" = oom ]; then
  echo "ficc-test-barrier: starting the runtime" >&2
  exec awk 'BEGIN { s = "x"; while (1) s = s s }'
fi
mkdir -p "$status" || exit 121
: > "$status/devices.tmp" || exit 121
for kind in positive negative; do
  n=$1
  shift
  while [ "$n" -gt 0 ]; do
    if (exec 3<"$1") 2>&-; then echo "1 $1"; else echo "0 $1"; fi >> "$status/devices.tmp"
    shift
    n=$((n - 1))
  done
done
mv "$status/devices.tmp" "$status/devices" || exit 121
if [ "$hold" = 1 ]; then
  while [ ! -e "$status/go" ]; do sleep 0.05; done
fi
echo $$ > "$status/pid.tmp" && mv "$status/pid.tmp" "$status/pid" || exit 121
while [ ! -e "$marker" ]; do sleep 0.05; done
"$@"
code=$?
echo "$code" > "$status/exit.tmp" && mv "$status/exit.tmp" "$status/exit"
case "$after" in
  +teardown) sleep 1; : > "$status/torn-down" ;;
  +stuck) sleep 600 ;;
esac
exit "$code"
"""
STATUS_DIRECTORY = ".ficc-test-provider"
HOLD_VARIABLE = "FICC_TEST_PROVIDER_HOLD"
"""A plan whose payload environment sets this to "1" is held before its PID is reported;
"fail" makes its barrier print a runtime's refusal on stderr and exit before release;
"oom" makes it grow until the out-of-memory killer kills it, before release."""
TEARDOWN_VARIABLE = "FICC_TEST_PROVIDER_TEARDOWN"
""""teardown" or "stuck": what the service's main process does after it reported the
payload's exit (see BARRIER_SCRIPT)."""
LATE_VARIABLE = "FICC_TEST_PROVIDER_LATE"
"""A plan whose payload environment sets this to "1" gets one late `observe` reply: the
first look that finds the PID but no exit report creates `observing` in the status
directory and answers only once the test has created `answer` there, so the payload
can end between the provider's look and the host's reading of the reply."""
LATE_WAIT = 60.0
_READ_LIMIT = 65536


def _read_report(directory: str, name: str) -> str | None:
    """A report file written by the (untrusted) barrier: no links, bounded, or None."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _READ_LIMIT).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _answer_late(status: str) -> None:
    """The one late look of a LATE_VARIABLE plan: announced, then held until the test
    lets it answer (later looks answer at once)."""
    try:
        os.close(os.open(os.path.join(status, "observing"), os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return
    deadline = time.monotonic() + LATE_WAIT
    while not os.path.exists(os.path.join(status, "answer")):
        if time.monotonic() > deadline:
            raise RuntimeError("the test never let the late observe answer")
        time.sleep(0.01)


class ServiceDriver(Driver):
    """The `service` runtime: the host's service runs the barrier; observe reads reports."""

    def __init__(
        self,
        argv: list[str],
        devices: dict[str, list[str]],
        negative: list[str],
        call_log: str | None,
    ) -> None:
        super().__init__(argv, call_log)
        self.devices = devices
        self.negative = negative

    @staticmethod
    def _status(context: Context) -> str:
        return os.path.join(context.storage.path, STATUS_DIRECTORY)

    def prepare(self, contexts: list[sdk.PrepareContext]) -> list[Reply]:
        self._logged("prepare", contexts)

        def row(context: sdk.PrepareContext) -> Reply:
            refused = self._check(context)  # lease and local authority, before preparing
            if refused is not None:
                return refused
            _leave_orphan(context)
            shell = os.path.realpath("/bin/sh")
            found = os.stat(shell)
            devices = []
            for name in context.plan.job.limits.devices:
                for path in self.devices[name]:
                    node = os.stat(path)
                    devices.append(
                        sdk.PreparedDevice(
                            name=name,
                            path=path,
                            major=os.major(node.st_rdev),
                            minor=os.minor(node.st_rdev),
                        )
                    )
            positive = [device.path for device in devices]
            job = context.plan.job
            hold = job.payload.environment.get(HOLD_VARIABLE, "0")
            after = job.payload.environment.get(TEARDOWN_VARIABLE, "")
            argv = [
                shell, "-c", BARRIER_SCRIPT, "ficc-test-barrier",
                context.release_marker, self._status(context),
                (hold if hold in ("1", "fail", "oom") else "0")
                + (f"+{after}" if after in ("teardown", "stuck") else ""),
                str(len(positive)), *positive, str(len(self.negative)), *self.negative,
                *job.payload.argv,
            ]  # fmt: skip
            result = sdk.PrepareResult(
                argv=argv,
                barrier=sdk.BarrierSpec(
                    path=shell, identity=sdk.Identity(device=found.st_dev, inode=found.st_ino)
                ),
                devices=devices,
                mounts=[],
                generated_targets=[],
                positive_devices=positive,
                negative_devices=list(self.negative),
            )
            return sdk.reply(result)

        return self._each(contexts, row)

    def start(self, contexts: list[Context]) -> list[Reply]:
        self._logged("start", contexts)
        return self._each(
            contexts,
            lambda c: (
                self._unverified(c)
                or _malformed("start", c)
                or sdk.reply(sdk.StartReply(started=True))
            ),
        )

    def observe(self, contexts: list[Context]) -> list[Reply]:
        self._logged("observe", contexts)

        def row(context: Context) -> Reply:
            status = self._status(context)
            code = _read_report(status, "exit")
            if code is not None:
                return sdk.reply(sdk.Observation(phase="finished", exit_code=int(code.strip())))
            results = _read_report(status, "devices")
            if results is None:
                return sdk.reply(sdk.Observation(phase="waiting"))
            devices = [
                sdk.DeviceOpen(path=line[2:], opened=line[0] == "1")
                for line in results.splitlines()
                if line[:2] in ("0 ", "1 ")
            ]
            pid = _read_report(status, "pid")
            if pid is None:
                return sdk.reply(sdk.Observation(phase="ready", devices=devices))
            ready_pid = _environment(context).get(READY_PID_VARIABLE) == "1"
            phase: Literal["ready", "payload"] = "ready" if ready_pid else "payload"
            observed = sdk.Observation(phase=phase, pid=int(pid.strip()), devices=devices)
            if _environment(context).get(LATE_VARIABLE) == "1":
                _answer_late(status)
            return sdk.reply(observed)

        return self._each(contexts, row)

    def stop(self, contexts: list[Context]) -> list[Reply]:
        self._logged("stop", contexts)
        return self._each(contexts, lambda _: sdk.reply(sdk.StopReply(stopped=True)))

    def release(self, contexts: list[Context]) -> list[Reply]:
        self._logged("release", contexts)
        return self._each(contexts, self._release)
