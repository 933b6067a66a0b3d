"""This host's GPUs as the Podman provider's `devices` entries (docs/operations.md, GPUs).

- NVIDIA (`/dev/nvidia0`, ...): with `nvidia-ctk`, a CDI spec it generates (JSON, the
  hooks the provider does not reproduce left out), one `cdi` entry per GPU; without
  it, a written bundle: `/dev/nvidiaN` own, `/dev/nvidiactl` and `/dev/nvidia-uvm*`
  shared, the driver's libraries found with `ldconfig -p` and `nvidia-smi`.
- AMD: each render node of an AMD device (`/sys/class/drm/renderD*/device/vendor`
  0x1002) own, `/dev/kfd` shared.
- Intel: each render node of an Intel device (0x8086) own.
- `synthetic`: the stand-ins of ficc_testkit.gpus (the dry run).

The entries are resolved by the provider's own code (`bundles.resolve`), so what the
check prints is exactly what a configured provider would grant.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NVIDIA_NODE = re.compile(r"\Anvidia([0-9]+)\Z")
NVIDIA_SHARED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
NVIDIA_LIBRARIES = re.compile(
    r"\A(libcuda|libcudadebugger|libnvidia-ml|libnvidia-ptxjitcompiler|libnvidia-nvvm)\.so\.\d+\Z"
)
UNREPRODUCED_HOOKS = ("enable-cuda-compat", "disable-device-node-modification",
                      "update-application-profile")  # fmt: skip
VENDORS = {"0x1002": ("AMD", "amd.com/gpu"), "0x8086": ("Intel", "intel.com/gpu")}


@dataclass
class Found:
    """The GPUs of one vendor: the provider's `devices` entries, one per GPU, in order."""

    vendor: str
    devices: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    programs: list[Path] = field(default_factory=list)
    """Host programs the job runs (`nvidia-smi`, a CUDA device query): their C
    libraries go into the job's image."""

    @property
    def names(self) -> list[str]:
        return [str(device["name"]) for device in self.devices]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def nvidia_nodes() -> list[int]:
    """The N of every `/dev/nvidiaN`, in order."""
    return sorted(
        int(match.group(1))
        for node in Path("/dev").iterdir()
        if (match := NVIDIA_NODE.match(node.name))
    )


def nvidia(work: Path) -> Found | None:
    """NVIDIA GPUs, or None when this host has no `/dev/nvidiaN` node."""
    indices = nvidia_nodes()
    if not indices:
        return None
    found = _nvidia_cdi(work, indices) if shutil.which("nvidia-ctk") else None
    if found is None:
        found = _nvidia_written(indices)
    query = shutil.which("deviceQuery") or "/usr/local/cuda/extras/demo_suite/deviceQuery"
    if Path(query).is_file():
        found.programs.append(Path(query))
    else:
        found.notes.append("no CUDA device query on this host (deviceQuery): nvidia-smi only")
    return found


def _nvidia_cdi(work: Path, indices: list[int]) -> Found | None:
    """The GPUs of the spec `nvidia-ctk cdi generate` writes, or None if it fails."""
    spec = work / "nvidia.json"
    command = ["nvidia-ctk", "cdi", "generate", "--format=json", f"--output={spec}"]
    disabled = [argument for hook in UNREPRODUCED_HOOKS for argument in ("--disable-hook", hook)]
    done = _run([*command, *disabled])
    if done.returncode != 0:  # an nvidia-ctk before --disable-hook
        done = _run(command)
    if done.returncode != 0 or not spec.is_file():
        return None
    spec.chmod(0o644)
    document = json.loads(spec.read_text())
    edits = [document.get("containerEdits", {})]
    edits += [device.get("containerEdits", {}) for device in document.get("devices", [])]
    sockets = sorted(
        {m["containerPath"] for e in edits for m in e.get("mounts", [])
         if not Path(m["hostPath"]).is_file() or Path(m["hostPath"]).is_symlink()}
    )  # fmt: skip
    names = [d["name"] for d in document.get("devices", []) if str(d["name"]).isdigit()]
    devices = [
        {
            "name": f"gpu{name}",
            "cdi": {"spec": str(spec), "device": f"{document['kind']}={name}", "exclude": sockets},
        }
        for name in names
    ]
    notes = [f"CDI spec {spec} from `{' '.join(command)}` ({document.get('cdiVersion')})"]
    notes += [f"left out of the spec (not a plain file): {path}" for path in sockets]
    smi = shutil.which("nvidia-smi")
    return Found("NVIDIA", devices, notes, [Path(smi)] if smi else [])


def _nvidia_written(indices: list[int]) -> Found:
    """The GPUs as written bundles: nodes from /dev, libraries from `ldconfig -p`."""
    shared = [f"/dev/{name}" for name in NVIDIA_SHARED if Path(f"/dev/{name}").exists()]
    mounts = [{"source": str(Path(path).resolve()), "target": path} for path in _libraries()]
    folders = sorted({str(Path(m["target"]).parent) for m in mounts})
    smi = shutil.which("nvidia-smi")
    notes = ["nvidia-ctk not found: nodes from /dev, driver libraries from `ldconfig -p`"]
    if smi:
        mounts.append({"source": str(Path(smi).resolve()), "target": "/usr/bin/nvidia-smi"})
    else:
        notes.append("nvidia-smi not found: the job reports its device opens only")
    if not mounts:
        notes.append("no NVIDIA driver library in `ldconfig -p`")
    if Path("/dev/nvidia-caps").is_dir():
        notes.append("/dev/nvidia-caps left out (MIG capabilities: not lent by this check)")
    devices = [
        {
            "name": f"gpu{index}",
            "kind": "nvidia.com/gpu",
            "nodes": [f"/dev/nvidia{index}"],
            "shared_nodes": shared,
            "mounts": mounts,
            "environment": {"LD_LIBRARY_PATH": ":".join(folders)} if folders else {},
        }
        for index in indices
    ]
    return Found("NVIDIA", devices, notes, [Path(smi)] if smi else [])


def _libraries() -> list[str]:
    """The 64-bit NVIDIA driver libraries `ldconfig -p` lists, by the name programs load."""
    listed = _run(["ldconfig", "-p"]).stdout.splitlines()
    found = []
    for line in listed:
        name, _, rest = line.strip().partition(" (")
        if NVIDIA_LIBRARIES.match(name) and "x86-64" in rest and " => " in rest:
            found.append(rest.rsplit(" => ", 1)[1].strip())
    return sorted(set(found))


def render_nodes() -> Found | None:
    """AMD or Intel render nodes (the first vendor found), or None."""
    by_vendor: dict[str, list[str]] = {}
    for node in sorted(Path("/sys/class/drm").glob("renderD*")):
        try:
            vendor = (node / "device" / "vendor").read_text().strip()
        except OSError:
            continue
        if vendor in VENDORS:
            by_vendor.setdefault(vendor, []).append(f"/dev/dri/{node.name}")
    for vendor, nodes in by_vendor.items():
        name, kind = VENDORS[vendor]
        shared = ["/dev/kfd"] if name == "AMD" and Path("/dev/kfd").exists() else []
        devices = [
            {"name": f"gpu{i}", "kind": kind, "nodes": [path], "shared_nodes": shared}
            for i, path in enumerate(nodes)
        ]
        notes = [f"{name} render nodes from /sys/class/drm; the job reports its device opens"]
        return Found(name, devices, notes)
    return None


def absent() -> str:
    """What was looked for, for the no-GPU verdict."""
    return "no /dev/nvidia[0-9]* node and no AMD or Intel render node in /sys/class/drm"
