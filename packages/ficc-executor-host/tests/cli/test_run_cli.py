"""`ficc-executor run`'s own pieces, without a daemon: its progress line on a terminal
and in a log, its output directory, and its refusals of what it can judge alone (each
with a code and exit status 125, before anything is sent). The command against the
real daemon and real Podman is tests-integration/test_run_command.py."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from ficc.execution.host.cli.job_steps import Chunk, Phase
from ficc.execution.host.cli.run import DirectorySink, make_directory
from ficc.execution.host.cli.run_progress import CLEAR, PLAIN_EVERY_S, ProgressLine, size
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

COMMAND = Path(sys.executable).parent / "ficc-executor"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_the_progress_line_is_rewritten_under_the_step_lines() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = ProgressLine(stream, 3 << 20, tty=True, clock=clock)
    progress.phase(Phase.UPLOAD)
    clock.now += 1.5
    progress.uploaded("data.bin", 1 << 20, 3 << 20)
    progress.note("upload: data.bin complete")
    progress.close()
    assert stream.getvalue() == (
        f"{CLEAR}[   0.0 s] uploading, uploaded 0 B of 3.0 MiB"
        f"{CLEAR}[   1.5 s] uploading, uploaded 1.0 MiB of 3.0 MiB"
        f"{CLEAR}[   1.5 s] upload: data.bin complete\n"
        f"{CLEAR}[   1.5 s] uploading, uploaded 1.0 MiB of 3.0 MiB"
        f"{CLEAR}"
    )


def test_in_a_log_steps_are_lines_and_progress_a_line_every_ten_seconds_of_quiet() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = ProgressLine(stream, 0, tty=False, clock=clock)
    progress.note("start: accepted")
    progress.phase(Phase.RUN)
    clock.now += PLAIN_EVERY_S - 1
    progress.phase(Phase.RUN)
    clock.now += 1
    progress.phase(Phase.RUN)
    progress.phase(Phase.RUN)
    assert stream.getvalue().splitlines() == ["[   0.0 s] start: accepted", "[  10.0 s] running"]


@pytest.mark.parametrize(
    ("count", "shown"),
    [(43, "43 B"), (1536, "1.5 KiB"), (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB")],
)
def test_sizes_are_shown_in_the_unit_that_fits(count: int, shown: str) -> None:
    assert size(count) == shown


def test_collected_objects_land_as_files_and_a_replaced_one_starts_again(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path)
    sink.store(Chunk("stdout", 0, b"hello "))
    sink.store(Chunk("stdout", 6, b"world\n"))
    sink.store(Chunk("output:result", 0, b"old"))
    sink.store(Chunk("output:result", 0, b"", restart=True))
    sink.store(Chunk("output:result", 0, b"new"))
    sink.store(Chunk("stderr", 0, b""))
    sink.close()
    assert (tmp_path / "stdout").read_bytes() == b"hello world\n"
    assert (tmp_path / "outputs" / "result").read_bytes() == b"new"
    assert (tmp_path / "stderr").read_bytes() == b""


def test_the_output_directory_is_new_or_empty(tmp_path: Path) -> None:
    made = make_directory(str(tmp_path / "out"), "ab" * 16)
    assert (made.stat().st_mode & 0o777) == 0o700
    assert make_directory(str(made), "ab" * 16) == made  # empty: fine
    (made / "stdout").write_text("earlier run")
    with pytest.raises(HostError) as raised:
        make_directory(str(made), "ab" * 16)
    assert raised.value.code == HostCode.RUN_OUTPUT_DIR
    assert "name a new one with --output-dir" in raised.value.message


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(COMMAND), "run", *argv], capture_output=True, text=True, check=False,
        timeout=60, cwd=cwd,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "run_usage: give --plan FILE, or the job's command line after --"),
        (["--plan", "p.json", "--", "/bin/true"], "run_usage: give --plan FILE or a command line"),
        (["--env", "A", "--", "/bin/true"], "run_usage: --env 'A' is not NAME=VALUE"),
        (["--plan", "missing.json"], "run_plan_invalid: cannot read the plan missing.json"),
        (["--plan", "p.json"], "run_input_not_given: the plan streams input 'greeting.txt'"),
        (["--plan", "p.json", "--input", "x=y"], "run_input_undeclared: --input x"),
        (["--plan", "p.json", "--input", "greeting.txt=nothing.txt"],
         "run_input_unreadable: --input greeting.txt=nothing.txt: cannot read the file"),
        (["--memory", "lots", "--", "/bin/true"], "argument --memory: 'lots' is not a size"),
        (["--resume", "."], "run_resume:"),
    ],
)  # fmt: skip
def test_what_the_command_can_judge_alone_is_refused_with_125(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    """Nothing here reaches a daemon: there is none, and none is needed to refuse."""
    example = Path(__file__).resolve().parents[4] / "docs" / "examples" / "podman-first-job.json"
    (tmp_path / "p.json").write_text(example.read_text())
    shown = run(*argv, cwd=tmp_path)
    assert shown.returncode == 125, shown.stderr
    assert says in shown.stderr, shown.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no directory made


def test_without_a_daemon_the_refusal_names_the_socket(tmp_path: Path) -> None:
    socket = tmp_path / "none.sock"
    shown = run("--socket", str(socket), "--image", "sha256:" + "0" * 64, "--", "/bin/true",
                cwd=tmp_path)  # fmt: skip
    assert shown.returncode == 125
    assert shown.stderr.startswith(f"run_no_daemon: no daemon answers on {socket}")


def test_the_usage_text_shows_both_forms_and_resume() -> None:
    shown = subprocess.run(
        [str(COMMAND), "run", "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    assert shown.stdout.startswith(
        "usage: ficc-executor run --plan FILE [--input NAME=FILE ...] [options]\n"
        "       ficc-executor run [--image DIGEST] [--class CLASS] [options] -- ARGV ...\n"
        "       ficc-executor run --resume DIR\n"
    )
    for code in ("123", "124", "125", "130"):
        assert code in shown.stdout
