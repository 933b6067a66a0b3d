"""What `status` says of the running daemon: the versions it runs against the installed
ones, a daemon too old to say, and each slot's health (the daemon end to end is in
tests-integration/test_daemon_slot_health.py and test_daemon_versions.py)."""

from __future__ import annotations

from ficc.execution.host.cli.running import Running, daemon_lines, running_json, slot_lines
from ficc.execution.wire import DaemonInfo, Error, RunningVersion, SlotState

STARTED_MS = 1_800_000_000_000  # 2027-01-15T08:00:00Z
DAEMON = DaemonInfo(
    started_at_ms=STARTED_MS,
    versions=[
        RunningVersion("ficc-executor-host", "0.1.0"),
        RunningVersion("ficc-protocol", "0.1.0"),
    ],
)
SAME = {"ficc-executor-host": "0.1.0", "ficc-protocol": "0.1.0"}


def running(installed: dict[str, str], **fields: object) -> Running:
    defaults: dict[str, object] = {"daemon": DAEMON, "slots": None, "usable": {}}
    return Running(installed=installed, **{**defaults, **fields})  # type: ignore[arg-type]


def test_the_daemon_line_names_what_runs_and_since_when() -> None:
    assert daemon_lines(running(SAME)) == ["daemon         0.1.0   started 2027-01-15T08:00:00Z"]
    assert running(SAME).differences() == []


def test_an_installed_release_not_yet_running_is_named() -> None:
    newer = {**SAME, "ficc-executor-host": "0.2.0"}
    lines = daemon_lines(running(newer))
    assert lines[0].startswith("daemon         0.1.0   started ")
    assert lines[1] == (
        "  installed    ficc-executor-host 0.2.0, but the daemon runs 0.1.0: restart the"
        " daemon to run what is installed"
    )
    shown = running_json(running(newer))
    assert shown["installed_differs"] == [
        {"distribution": "ficc-executor-host", "running": "0.1.0", "installed": "0.2.0"}
    ]


def test_a_daemon_older_than_the_fields_is_said_to_be_older_never_guessed() -> None:
    old = running(SAME, daemon=None, refusal=Error("invalid_request", "unknown field `daemon`"))
    (line,) = daemon_lines(old)
    assert line.startswith("daemon         not reported: the running daemon is older than")
    assert "restart it" in line
    assert old.version is None
    busy = running(SAME, daemon=None, refusal=Error("busy", "too many connections"))
    assert daemon_lines(busy) == ["daemon         not reported (busy: too many connections)"]


def test_each_slot_shows_its_state_and_a_broken_one_why() -> None:
    slots = [
        SlotState(id="s0", class_="small", healthy=False, free=True, reason="slot_filesystem",
                  message="slot s0: /srv/s0 is not mounted; mount it", since_ms=STARTED_MS),
        SlotState(id="s1", class_="small", healthy=True, free=False, reason=None, message=None,
                  since_ms=STARTED_MS),
    ]  # fmt: skip
    text = "\n".join(slot_lines(running(SAME, slots=slots, usable={"small": (0, 2)})))
    lines = text.splitlines()
    table = [line.split() for line in lines[1:4]]
    assert table[0] == ["SLOT", "CLASS", "STATE", "FREE", "SINCE", "(UTC)", "REASON"]
    assert table[1] == ["s0", "small", "BROKEN", "yes", "2027-01-15T08:00:00Z", "slot_filesystem"]
    assert table[2] == ["s1", "small", "ok", "no", "2027-01-15T08:00:00Z", "-"]
    assert "  s0: /srv/s0 is not mounted; mount it" in lines
    assert lines[-1] == "usable now     small 0 of 2"
    assert slot_lines(running(SAME)) == []  # not reported: nothing shown
