"""The Windows lock's call shapes, against a stand-in for kernel32 compiled here.

There is no Windows machine to test on. What these tests prove: the exact prototype
ctypes is given for `LockFileEx` (six arguments: a pointer-sized handle, four 32-bit
DWORDs and a pointer to an OVERLAPPED with the Windows x64 layout), the values
passed (exclusive + fail-immediately flags, reserved 0, one byte, at the offset far
past the marker), and how a held lock and other failures are reported. They are
marshalled through a real C function in a shared library, so a wrong argument type
or structure layout fails here as it would against kernel32. What they do not
prove: Windows' calling convention and its own lock semantics (mandatory byte-range
locks, release on handle close), `msvcrt.get_osfhandle`, or anything about
durability on Windows, which is not promised.
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest

from ficc.hoststate import lock

STAND_IN = r"""
#include <stdint.h>
#include <stddef.h>

typedef struct {
    size_t Internal, InternalHigh;
    uint32_t Offset, OffsetHigh;
    void *hEvent;
} OVERLAPPED;

static void *held_by;
static uint32_t last_error, forced_error;
static uint64_t seen[8];

/* BOOL LockFileEx(HANDLE, DWORD, DWORD, DWORD, DWORD, LPOVERLAPPED), emulating one
   exclusive byte-range lock: a second handle is refused at once. */
int LockFileEx(void *handle, uint32_t flags, uint32_t reserved, uint32_t low,
               uint32_t high, OVERLAPPED *overlapped) {
    seen[0] = (uint64_t)(uintptr_t)handle;
    seen[1] = flags;
    seen[2] = reserved;
    seen[3] = low;
    seen[4] = high;
    seen[5] = overlapped->Offset;
    seen[6] = overlapped->OffsetHigh;
    seen[7] = (uint64_t)(uintptr_t)overlapped->hEvent;
    if (forced_error != 0) { last_error = forced_error; return 0; }
    if (reserved != 0 || overlapped == NULL) { last_error = 87; return 0; }
    if (held_by != NULL && held_by != handle) { last_error = 33; return 0; }
    held_by = handle;
    return 1;
}

uint32_t StandInLastError(void) { return last_error; }
uint64_t StandInSeen(int i) { return seen[i]; }
void StandInRelease(void) { held_by = NULL; }
void StandInFail(uint32_t error) { forced_error = error; }
"""


@pytest.fixture
def kernel32(tmp_path: pathlib.Path) -> ctypes.CDLL:
    if shutil.which("cc") is None:
        pytest.skip(
            "a C compiler is needed to build the kernel32 stand-in (tools/dev installs gcc)"
        )
    source = tmp_path / "kernel32.c"
    source.write_text(STAND_IN)
    library = tmp_path / "kernel32-stand-in.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.StandInLastError.restype = ctypes.c_uint32
    lib.StandInSeen.restype = ctypes.c_uint64
    lib.StandInSeen.argtypes = (ctypes.c_int,)
    return lib


def test_the_overlapped_structure_has_the_windows_x64_layout() -> None:
    assert ctypes.sizeof(lock.OVERLAPPED) == 32
    assert lock.OVERLAPPED.Offset.offset == 16
    assert lock.OVERLAPPED.OffsetHigh.offset == 20
    assert lock.OVERLAPPED.hEvent.offset == 24


def test_lock_file_ex_is_called_with_the_exact_arguments(kernel32: ctypes.CDLL) -> None:
    lock_file = lock.bind_lock_file_ex(kernel32)
    handle = 0x7FF6_0000_1234  # handles are pointer-sized: nothing may be truncated
    lock.lock_file_ex(handle, lock_file, kernel32.StandInLastError)
    seen = [kernel32.StandInSeen(i) for i in range(8)]
    assert seen == [handle, 0x3, 0, 1, 0, 0x7FFF_FFF0, 0, 0]


def test_a_lock_held_by_another_handle_is_busy_and_maps_to_locked(
    kernel32: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock_file = lock.bind_lock_file_ex(kernel32)
    lock.lock_file_ex(1111, lock_file, kernel32.StandInLastError)
    with pytest.raises(BlockingIOError) as busy:
        lock.lock_file_ex(2222, lock_file, kernel32.StandInLastError)
    assert busy.value.errno == lock.ERROR_LOCK_VIOLATION
    # lock_exclusive turns that into the Locked refusal, as on Linux
    monkeypatch.setattr(
        lock, "_lock", lambda fd: lock.lock_file_ex(fd, lock_file, kernel32.StandInLastError)
    )
    with pytest.raises(lock.Locked, match=r"never delete host\.lock"):
        lock.lock_exclusive(3333, "C:/state")
    kernel32.StandInRelease()
    lock.lock_exclusive(3333, "C:/state")  # once released, another handle gets it


def test_other_failures_are_errors_not_busy(kernel32: ctypes.CDLL) -> None:
    lock_file = lock.bind_lock_file_ex(kernel32)
    kernel32.StandInFail(6)  # ERROR_INVALID_HANDLE
    with pytest.raises(OSError) as failed:
        lock.lock_file_ex(4444, lock_file, kernel32.StandInLastError)
    assert not isinstance(failed.value, BlockingIOError)
    assert failed.value.errno == 6
