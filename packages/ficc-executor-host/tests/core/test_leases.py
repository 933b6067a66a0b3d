"""Lease rules on (boot ID, CLOCK_BOOTTIME): pure tests with chosen clocks, one real clock."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease, Now, grant, is_current, remaining_ns, renew
from ficc.execution.host.linux.clock import BOOT_ID_PATH, BootClock, read_boot_id

BOOT = "5d714fed-8ede-4113-89a0-7d5338beb1e8"
OTHER_BOOT = "00000000-1111-2222-3333-444444444444"
MS = 1_000_000
S = 1_000_000_000
WALL = 1_800_000_000_000 * MS  # a wall time in 2027
CAP = 600  # maximum_lease_seconds


class Terms(msgspec.Struct, frozen=True):
    sequence: int
    expires_at_ms: int


def at(boottime_s: float, wall_offset_s: float = 0.0, boot: str = BOOT) -> Now:
    """A clock reading: boot time, and wall time offset from WALL by the same amount."""
    return Now(
        boot_id=boot,
        boottime_ns=int(boottime_s * S),
        wall_ns=WALL + int((boottime_s + wall_offset_s) * S),
    )


def wall_ms(seconds_after_wall: float) -> int:
    return (WALL + int(seconds_after_wall * S)) // MS


def code_of(call: object) -> str:
    assert callable(call)
    with pytest.raises(HostError) as excinfo:
        call()
    return excinfo.value.code


# --- grant -----------------------------------------------------------------------------


def test_grant_converts_the_wall_expiry_to_a_boot_clock_deadline() -> None:
    lease = grant(Terms(1, wall_ms(100 + 60)), at(100), CAP)
    assert lease == Lease(BOOT, 1, wall_ms(160), 160 * S, wall_ms(160))


def test_grant_caps_the_deadline_at_the_maximum_lease() -> None:
    lease = grant(Terms(1, wall_ms(100 + 10 * CAP)), at(100), CAP)
    assert lease.deadline_boottime_ns == (100 + CAP) * S
    assert lease.expires_at_ms == wall_ms(100 + 10 * CAP)  # the terms are kept as sent
    assert lease.effective_expires_at_ms == wall_ms(100 + CAP)  # what the host enforces


def test_the_effective_expiry_of_an_endless_renewal_is_the_cap() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    assert lease.effective_expires_at_ms == wall_ms(160)  # uncapped: exactly as asked
    endless = renew(lease, Terms(2, 2**63 - 1), at(150), CAP)
    assert endless.expires_at_ms == 2**63 - 1
    assert endless.effective_expires_at_ms == wall_ms(150 + CAP)
    # a duplicate received later keeps the deadline and its effective expiry
    assert renew(endless, Terms(2, 2**63 - 1), at(400), CAP) == endless


def test_a_renewal_already_past_is_effective_at_receipt() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    ended = renew(lease, Terms(2, wall_ms(50)), at(150), CAP)
    assert ended.effective_expires_at_ms == wall_ms(150)
    assert ended.deadline_boottime_ns == 150 * S


@pytest.mark.parametrize("seconds", [-1, 0])
def test_grant_refuses_an_expiry_that_is_not_in_the_future(seconds: int) -> None:
    assert code_of(lambda: grant(Terms(1, wall_ms(100 + seconds)), at(100), CAP)) == (
        "lease_expired"
    )


@pytest.mark.parametrize("sequence", [0, 2, 7])
def test_grant_requires_sequence_one(sequence: int) -> None:
    assert code_of(lambda: grant(Terms(sequence, wall_ms(160)), at(100), CAP)) == ("lease_sequence")


# --- is_current ------------------------------------------------------------------------


def test_a_lease_is_current_strictly_before_its_deadline() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    assert is_current(lease, at(159.999999999))
    assert not is_current(lease, at(160))
    assert remaining_ns(lease, at(150)) == 10 * S
    assert remaining_ns(lease, at(170)) == 0


def test_a_changed_boot_id_makes_the_lease_not_current() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    after_reboot = at(1, boot=OTHER_BOOT)  # boot time starts again near zero
    assert not is_current(lease, after_reboot)
    assert remaining_ns(lease, after_reboot) == 0


def test_a_wall_clock_rollback_does_not_extend_a_deadline() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    rolled_back = at(161, wall_offset_s=-3600)  # the wall clock says an hour earlier
    assert not is_current(lease, rolled_back)


def test_suspend_consumes_lease_time() -> None:
    """CLOCK_BOOTTIME counts suspended time: waking up after the deadline is expired."""
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    assert not is_current(lease, at(100 + 3600))


def test_a_stored_lease_means_the_same_after_a_restart() -> None:
    """A restarted daemon decodes the recorded lease; its deadline cannot have moved."""
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    stored = msgspec.json.decode(msgspec.json.encode(lease), type=Lease)
    assert stored == lease
    assert is_current(stored, at(150))
    assert not is_current(stored, at(160))


# --- renew -----------------------------------------------------------------------------


def test_renew_with_a_higher_sequence_moves_the_deadline() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(220)), at(150), CAP)
    assert renewed == Lease(BOOT, 2, wall_ms(220), 220 * S, wall_ms(220))


def test_renew_caps_the_deadline_at_the_maximum_lease() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(150 + 5 * CAP)), at(150), CAP)
    assert renewed.deadline_boottime_ns == (150 + CAP) * S


def test_an_identical_duplicate_keeps_the_original_deadline() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(220)), at(150), CAP)
    # Recomputing at 200 would give 220; the duplicate must not move it at all, even
    # with the wall clock rolled back a minute (which would give 280).
    again = renew(renewed, Terms(2, wall_ms(220)), at(200, wall_offset_s=-60), CAP)
    assert again is renewed


def test_a_duplicate_of_the_first_lease_keeps_its_deadline() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    assert renew(lease, Terms(1, wall_ms(160)), at(159, wall_offset_s=-30), CAP) is lease


def test_the_same_sequence_with_another_expiry_is_refused() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(220)), at(150), CAP)
    assert code_of(lambda: renew(renewed, Terms(2, wall_ms(230)), at(151), CAP)) == (
        "lease_sequence"
    )


@pytest.mark.parametrize("sequence", [1, 2])
def test_a_stale_sequence_is_refused(sequence: int) -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    lease = renew(lease, Terms(3, wall_ms(220)), at(150), CAP)
    assert code_of(lambda: renew(lease, Terms(sequence, wall_ms(300)), at(151), CAP)) == (
        "lease_sequence"
    )


def test_an_expired_lease_cannot_be_renewed() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    assert code_of(lambda: renew(lease, Terms(2, wall_ms(400)), at(160), CAP)) == ("lease_expired")
    assert code_of(lambda: renew(lease, Terms(1, wall_ms(160)), at(161), CAP)) == ("lease_expired")


def test_a_lease_from_another_boot_cannot_be_renewed() -> None:
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    after_reboot = at(5, boot=OTHER_BOOT)
    assert code_of(lambda: renew(lease, Terms(2, wall_ms(400)), after_reboot, CAP)) == (
        "lease_expired"
    )


def test_a_renewal_may_shorten_the_lease() -> None:
    lease = grant(Terms(1, wall_ms(400)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(170)), at(150), CAP)
    assert renewed.deadline_boottime_ns == 170 * S


def test_a_renewal_whose_expiry_has_passed_ends_the_lease_at_once() -> None:
    lease = grant(Terms(1, wall_ms(400)), at(100), CAP)
    renewed = renew(lease, Terms(2, wall_ms(140)), at(150), CAP)
    assert renewed.sequence == 2
    assert not is_current(renewed, at(150))


def test_after_a_wall_rollback_a_new_renewal_counts_from_the_boot_clock() -> None:
    """Only a new, higher renewal can give more time, and never more than the cap."""
    lease = grant(Terms(1, wall_ms(160)), at(100), CAP)
    rolled = at(150, wall_offset_s=-3600)
    renewed = renew(lease, Terms(2, wall_ms(160)), rolled, CAP)
    assert renewed.deadline_boottime_ns == (150 + CAP) * S


# --- property: nothing but a new renewal moves a deadline, and never past the cap ------

_EXAMPLES = 5000 if os.environ.get("FICC_SOAK") == "1" else 300

_step = st.tuples(
    st.integers(min_value=0, max_value=10 * S),  # boot time advances (maybe by a suspend)
    st.integers(min_value=-3600 * S, max_value=3600 * S),  # the wall clock jumps anywhere
    st.integers(min_value=-2, max_value=3),  # sequence relative to the current one
    st.integers(min_value=-60_000, max_value=2 * CAP * 1000),  # expiry relative to wall
    st.booleans(),  # reboot before this step
)


@pytest.mark.soak
@settings(max_examples=_EXAMPLES, deadline=None)
@given(st.lists(_step, min_size=1, max_size=30))
def test_no_clock_movement_extends_a_lease(
    steps: list[tuple[int, int, int, int, bool]],
) -> None:
    boot, boottime, wall = BOOT, 10 * S, WALL
    lease = grant(Terms(1, wall // MS + 30_000), Now(boot, boottime, wall), CAP)
    for advance, jump, relative_sequence, relative_expiry, reboot in steps:
        boottime += advance
        wall += advance + jump
        if reboot:
            boot, boottime = OTHER_BOOT, advance
        now = Now(boot, boottime, wall)
        terms = Terms(max(1, lease.sequence + relative_sequence), wall // MS + relative_expiry)
        was_current = is_current(lease, now)
        outcome = _renew_or_code(lease, terms, now)
        duplicate = terms == Terms(lease.sequence, lease.expires_at_ms)
        if not was_current:
            assert outcome == "lease_expired"
        elif terms.sequence < lease.sequence or (
            terms.sequence == lease.sequence and not duplicate
        ):
            assert outcome == "lease_sequence"
        elif duplicate:
            assert outcome is lease
        else:
            assert isinstance(outcome, Lease)
            assert outcome.sequence > lease.sequence
            assert outcome.deadline_boottime_ns <= now.boottime_ns + CAP * S
            lease = outcome


def _renew_or_code(lease: Lease, terms: Terms, now: Now) -> Lease | str:
    try:
        return renew(lease, terms, now, CAP)
    except HostError as error:
        return error.code


# --- the real clock --------------------------------------------------------------------


def test_the_real_clock_reads_this_boot() -> None:
    clock = BootClock()
    first, second = clock.now(), clock.now()
    assert first.boot_id == Path(BOOT_ID_PATH).read_text().strip()
    assert second.boottime_ns >= first.boottime_ns > 0
    lease = grant(Terms(1, second.wall_ns // MS + 60_000), second, CAP)
    assert is_current(lease, clock.now())
    assert 0 < remaining_ns(lease, clock.now()) <= 60 * S


def test_a_bad_boot_id_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "boot_id"
    bad.write_text("not a boot id\n")
    assert code_of(lambda: read_boot_id(str(bad))) == "clock_unavailable"
    assert code_of(lambda: read_boot_id(str(tmp_path / "missing"))) == "clock_unavailable"


def test_a_recorded_lease_with_a_malformed_boot_id_is_refused_on_decode() -> None:
    good = msgspec.json.encode(Lease(BOOT, 1, 2, 3, 2))
    assert msgspec.json.decode(good, type=Lease) == Lease(BOOT, 1, 2, 3, 2)
    for bad in (BOOT + "\n", BOOT.upper(), BOOT[:-1]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(
                good.replace(BOOT.encode(), msgspec.json.encode(bad)[1:-1]), type=Lease
            )


# --- what the docs promise -----------------------------------------------------------

_REPO = Path(__file__).resolve().parents[4]


def _promise(path: Path) -> str:
    """The quoted lease promise that follows "word for word" in a document."""
    text = path.read_text()
    after = text[text.index("word for word") :].split("\n")[1:]
    start = next(i for i, line in enumerate(after) if line.strip().startswith(">"))
    block = [line.strip() for line in after[start:]]
    quoted = block[: block.index("")] if "" in block else block
    return " ".join(line.lstrip("> ").strip() for line in quoted)


def test_the_readme_and_operations_make_the_same_lease_promise() -> None:
    readme = _promise(_REPO / "packages" / "ficc-executor-host" / "README.md")
    operations = _promise(_REPO / "docs" / "operations.md")
    assert readme == operations
    assert "lease_expired" in readme
