"""The kit reads the daemon's process settings from the shipped unit file itself."""

from __future__ import annotations

import pytest

from ficc_testkit.unit import SYSTEMD_PATH, parse_unit, shipped_settings

UNIT_TEXT = """
[Unit]
Description=x
Environment=IGNORED=unit-section

[Service]
# a comment
ExecStart=/opt/venv/bin/python -I -X dev -m ficc.execution serve --config /etc/x.toml
UMask=0077
Environment=A=1 "B=two words"
Environment=MALLOC_MMAP_THRESHOLD_=1048576
LimitNOFILE=16384
LimitCORE=0
"""


def test_the_units_umask_environment_limits_and_python_flags_are_read() -> None:
    settings = parse_unit(UNIT_TEXT)
    assert settings.umask == 0o077
    assert settings.environment == {"A": "1", "B": "two words", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    assert settings.limits == {"LimitNOFILE": "16384", "LimitCORE": "0"}
    assert settings.python_flags == ("-I", "-X")
    assert settings.command("/py", "serve") == [
        "prlimit", "--nofile=16384:16384", "--core=0:0", "--",
        "/py", "-I", "-X", "-m", "ficc.execution", "serve",
    ]  # fmt: skip


def test_the_daemons_environment_is_systemds_not_the_callers() -> None:
    environment = parse_unit(UNIT_TEXT).process_environment({"NOTIFY_SOCKET": "/n"})
    assert environment["PATH"] == SYSTEMD_PATH
    assert environment["NOTIFY_SOCKET"] == "/n"
    assert "HOME" not in environment
    assert "IGNORED" not in environment


def test_a_unit_without_umask_is_refused() -> None:
    with pytest.raises(ValueError, match="UMask"):
        parse_unit("[Service]\nExecStart=/bin/true\n")


def test_the_shipped_unit_gives_the_private_umask_and_isolated_python() -> None:
    settings = shipped_settings()
    assert settings.umask == 0o077
    assert "-I" in settings.python_flags
    assert settings.limits["LimitNOFILE"] == "16384"
