"""A synthetic GPU host: real character nodes, driver stand-ins and a vendor-shaped CDI spec.

A machine without a GPU can still lend "GPUs" whose isolation is real: each stand-in
GPU is a character node made with mknod under `/dev` (the host's device file system,
where nodes can be opened; `/run` is often mounted `nodev`) with the numbers of an
existing harmless device, so opening it really reaches a driver, and the device
policy of a job's service really decides whether it opens. Distinct numbers stand in
for the per-GPU nodes and for the node every GPU of the kind shares:

| stand-in | path (`/dev/ficc-gpu-<tag>/`) | numbers of |
|---|---|---|
| GPU 0 (own) | `nvidia0` | /dev/zero |
| GPU 1 (own) | `nvidia1` | /dev/full |
| control node (shared) | `nvidiactl` | /dev/fuse |

The driver's user-space files are root-owned read-only files: `libcuda.so.999.88.77`,
a minimal ELF shared object whose DT_SONAME is `libcuda.so.1` (the provider reads it
to reproduce `ldconfig`), and `nvidia-smi`, a shell script that lists the GPUs whose
node opens, as `nvidia-smi -L` lists the GPUs a job can use.

`nvidia.json` is a CDI spec of exactly the shape `nvidia-ctk cdi generate
--format=json` writes: devices `0`, `1` and `all`, each with its own node and a link
under `by-path/` (NVIDIA's DRM by-path links), the control node, the mounts, the
environment and the `create-symlinks`, `update-ldcache` and `chmod` hooks at the
spec level. Used by tests-integration/test_podman_gpus.py and `tools/gpu/check
--dry-run`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficc_testkit.slots import private_directory, remove_tree

KIND = "nvidia.com/gpu"
LIBRARY_FOLDER = "/usr/lib/x86_64-linux-gnu"
LIBRARY = "libcuda.so.999.88.77"
SONAME = "libcuda.so.1"
TOOL_TARGET = "/usr/bin/nvidia-smi"
HOOK = "/usr/bin/nvidia-cdi-hook"
STAND_INS = {"nvidia0": "/dev/zero", "nvidia1": "/dev/full", "nvidiactl": "/dev/fuse"}
"""Node name -> the harmless device whose numbers it takes."""


@dataclass(frozen=True)
class SyntheticGpus:
    """What `synthetic_gpus` made; `gpus[i]` is the own node of device `i`."""

    nodes: Path
    files: Path
    gpus: tuple[Path, ...]
    control: Path
    library: Path
    tool: Path
    spec: Path

    def alias(self, index: int) -> str:
        """The by-path link of GPU `index` (the container sees the node there too)."""
        return f"{self.nodes}/by-path/pci-0000:0{index + 7}:00.0-gpu"

    def devices(self, names: tuple[str, ...] = ("gpu0", "gpu1")) -> list[dict[str, Any]]:
        """The provider's `devices` entries: `names[i]` is CDI device `i` of the spec."""
        return [
            {"name": name, "cdi": {"spec": str(self.spec), "device": f"{KIND}={index}"}}
            for index, name in enumerate(names)
        ]


def _numbers(path: str) -> int:
    st = os.stat(path)
    if not stat.S_ISCHR(st.st_mode):
        raise AssertionError(f"{path} is not a character device; a stand-in GPU takes its numbers")
    return st.st_rdev


def soname_library(soname: str) -> bytes:
    """A minimal 64-bit little-endian ELF shared object whose only content is a dynamic
    section naming `soname` (DT_SONAME): what the provider reads of a driver library."""
    strings = b"\x00" + soname.encode() + b"\x00"
    header, program = 64, 56
    dynamic_at = header + 2 * program
    entries = [(5, 0), (10, len(strings)), (14, 1), (0, 0)]  # STRTAB, STRSZ, SONAME, NULL
    strings_at = dynamic_at + 16 * len(entries)
    entries[0] = (5, strings_at)
    total = strings_at + len(strings)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    elf = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, header, 0, 0, 64, 56, 2, 64, 0, 0)
    elf += struct.pack("<IIQQQQQQ", 1, 4, 0, 0, 0, total, total, 0x1000)
    elf += struct.pack("<IIQQQQQQ", 2, 6, dynamic_at, dynamic_at, dynamic_at, 64, 64, 8)
    elf += b"".join(struct.pack("<qQ", tag, value) for tag, value in entries)
    return elf + strings


def tool_script(gpus: tuple[Path, ...]) -> bytes:
    """A stand-in `nvidia-smi`: `-L` lists the GPUs whose node opens in the job."""
    nodes = " ".join(str(gpu) for gpu in gpus)
    return (
        "#!/bin/sh\n"
        "# A stand-in for nvidia-smi -L: the GPUs whose node this process can open.\n"
        f"i=0\nfor node in {nodes}; do\n"
        '  if (exec 3<>"$node") 2>/dev/null; then\n'
        '    echo "GPU $i: ficc synthetic GPU (UUID: GPU-ficc-0000-$i)"\n'
        "  fi\n  i=$((i + 1))\ndone\n"
    ).encode()


def _root_file(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    os.chown(path, 0, 0)
    path.chmod(mode)


def cdi_spec(made: SyntheticGpus) -> dict[str, Any]:
    """The spec, in the shape and field order `nvidia-ctk cdi generate` writes."""
    mount_options = ["ro", "nosuid", "nodev", "bind"]

    def hook(*args: str) -> dict[str, Any]:
        return {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", *args],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }

    def device(name: str, gpus: list[int]) -> dict[str, Any]:
        nodes = [{"path": str(made.gpus[i]), "hostPath": str(made.gpus[i])} for i in gpus]
        links = [a for i in gpus for a in ("--link", f"../nvidia{i}::{made.alias(i)}")]
        edits: dict[str, Any] = {"deviceNodes": nodes, "hooks": [hook("create-symlinks", *links)]}
        return {"name": name, "containerEdits": edits}

    return {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": [device("0", [0]), device("1", [1]), device("all", [0, 1])],
        "containerEdits": {
            "env": [f"NVIDIA_CTK_LIBCUDA_DIR={LIBRARY_FOLDER}", "NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": str(made.control), "hostPath": str(made.control)}],
            "hooks": [
                hook("create-symlinks", "--link", f"{SONAME}::{LIBRARY_FOLDER}/libcuda.so"),
                hook("update-ldcache", "--folder", LIBRARY_FOLDER),
                hook("chmod", "--mode", "755", "--path", str(made.nodes)),
            ],
            "mounts": [
                {"hostPath": str(source), "containerPath": target, "options": mount_options}
                for source, target in (
                    (made.library, f"{LIBRARY_FOLDER}/{LIBRARY}"),
                    (made.tool, TOOL_TARGET),
                )
            ],
        },
    }


@contextmanager
def synthetic_gpus(parent: str) -> Iterator[SyntheticGpus]:
    """Make the stand-ins (nodes under `/dev/ficc-gpu-<tag>/`, files and the spec in a new
    root-owned directory under `parent`); remove all of them after."""
    tag = secrets.token_hex(3)
    nodes = Path(f"/dev/ficc-gpu-{tag}")
    files: Path | None = None
    try:
        nodes.mkdir(mode=0o755)
        for name, like in STAND_INS.items():
            os.mknod(nodes / name, 0o666 | stat.S_IFCHR, _numbers(like))
            (nodes / name).chmod(0o666)  # mknod applies the umask
        files = private_directory(parent, f"ficc-gpu-{tag}-")
        gpus = (nodes / "nvidia0", nodes / "nvidia1")
        made = SyntheticGpus(
            nodes, files, gpus, nodes / "nvidiactl", files / LIBRARY, files / "nvidia-smi",
            files / "nvidia.json",
        )  # fmt: skip
        _root_file(made.library, soname_library(SONAME), 0o644)
        _root_file(made.tool, tool_script(gpus), 0o755)
        _root_file(made.spec, json.dumps(cdi_spec(made), indent=2).encode(), 0o644)
        yield made
    finally:
        shutil.rmtree(nodes, ignore_errors=True)
        if files is not None:
            remove_tree(files)


def report_sections(text: str) -> dict[str, list[str]]:
    """A job's report split at its `== NAME` lines: each section's lines by name (the
    GPU jobs of the tests and of tools/gpu/check print their findings that way)."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line[3:], [])
        else:
            current.append(line)
    return sections
