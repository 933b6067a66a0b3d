"""Device bundles: configuration forms, CDI specs resolved exactly, and every refusal.

The stand-ins are real (ficc_testkit.gpus): character nodes made with mknod, a driver
library whose SONAME is read from its ELF dynamic section, a CDI spec of the shape
`nvidia-ctk cdi generate --format=json` writes, in a root-owned directory. Each test
changes one thing and shows the code the provider's `configure` refuses it with.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ficc_provider_podman import bundles, container, elf
from ficc_provider_podman import driver as podman_driver
from ficc_provider_podman.config import load
from ficc_provider_podman.errors import ProviderError
from ficc_testkit import gpus
from ficc_testkit.slots import private_directory, remove_tree

pytestmark = pytest.mark.root("mknod, and files and directories root must own")
SHA = "sha256:" + "a" * 64
Spec = dict[str, Any]


@pytest.fixture
def made() -> Iterator[gpus.SyntheticGpus]:
    with gpus.synthetic_gpus("/run") as stand_ins:
        yield stand_ins


@pytest.fixture
def root_dir() -> Iterator[Path]:
    path = private_directory("/run", "ficc-bundles-")
    try:
        yield path
    finally:
        remove_tree(path)


def _configuration(made: gpus.SyntheticGpus, devices: list[dict[str, Any]]) -> dict[str, Any]:
    archive = made.files / "image.tar"
    if not archive.exists():
        archive.write_bytes(b"never read at configure time")
    return {
        "images": [
            {"digest": SHA, "archive": str(archive), "archive_sha256": SHA, "image_id": SHA}
        ],
        "devices": devices,
    }


def _resolve(made: gpus.SyntheticGpus, devices: list[dict[str, Any]]) -> bundles.Bundles:
    return bundles.resolve(load(_configuration(made, devices)))


def _spec(made: gpus.SyntheticGpus) -> Spec:
    return copy.deepcopy(gpus.cdi_spec(made))


def _write_spec(made: gpus.SyntheticGpus, spec: Spec, name: str = "changed.json") -> str:
    path = made.files / name
    path.write_text(json.dumps(spec))
    path.chmod(0o644)
    return str(path)


def _refused(made: gpus.SyntheticGpus, spec: Spec, device: str = "nvidia.com/gpu=0") -> str:
    """The code configure refuses `spec`'s `device` with."""
    path = _write_spec(made, spec)
    with pytest.raises(ProviderError) as refused:
        podman_driver.configure(
            _configuration(made, [{"name": "gpu0", "cdi": {"spec": path, "device": device}}])
        )
    return refused.value.code


# --- what a vendor's spec resolves to -----------------------------------------------------


def test_a_vendor_spec_resolves_into_exact_nodes_mounts_and_environment(
    made: gpus.SyntheticGpus,
) -> None:
    """gpu0 of the spec: its own node (with its by-path link), the shared control node,
    the library at its name, at its SONAME (ldconfig's link) and at libcuda.so (the
    link hook's), the tool, each with the recorded identity of its one source file;
    the spec's environment and the library folder for the loader."""
    resolved = _resolve(made, made.devices())
    gpu0 = resolved.by_name["gpu0"]
    zero, control = os.stat("/dev/zero").st_rdev, os.stat("/dev/fuse").st_rdev
    assert [(n.path, n.major, n.minor, n.aliases) for n in gpu0.nodes] == [
        (str(made.gpus[0]), os.major(zero), os.minor(zero), (made.alias(0),))
    ]
    assert [(n.path, n.numbers) for n in gpu0.shared] == [
        (str(made.control), (os.major(control), os.minor(control)))
    ]
    library = os.stat(made.library)
    folder = gpus.LIBRARY_FOLDER
    assert {m.target: (m.source, m.identity) for m in gpu0.mounts} == {
        f"{folder}/{gpus.LIBRARY}": (str(made.library), (library.st_dev, library.st_ino)),
        f"{folder}/{gpus.SONAME}": (str(made.library), (library.st_dev, library.st_ino)),
        f"{folder}/libcuda.so": (str(made.library), (library.st_dev, library.st_ino)),
        gpus.TOOL_TARGET: (str(made.tool), (os.stat(made.tool).st_dev, os.stat(made.tool).st_ino)),
    }
    assert dict(gpu0.environment) == {
        "NVIDIA_CTK_LIBCUDA_DIR": folder,
        "NVIDIA_VISIBLE_DEVICES": "void",
        "LD_LIBRARY_PATH": folder,
    }
    assert (gpu0.kind, gpu0.origin) == ("nvidia.com/gpu", "cdi:nvidia.com/gpu=0")


def test_a_job_gets_its_gpu_and_the_shared_node_and_sees_the_other_gpu_refused(
    made: gpus.SyntheticGpus,
) -> None:
    """The prepare result's device part for a job holding gpu0: its node and the shared
    node are prepared (and positive, with the runtime's), gpu1 and its link are shown
    and negative; /dev/zero, which has gpu0's numbers here, is neither (it opens)."""
    config = load(_configuration(made, made.devices()))
    devices = container.plan_devices(config, ["gpu0"], bundles.resolve(config))
    gpu0, gpu1, control = (str(p) for p in (*made.gpus, made.control))
    assert [(d["name"], d["path"]) for d in devices.prepared][-2:] == [
        ("gpu0", gpu0),
        ("gpu0", control),
    ]
    assert devices.positive == sorted([gpu0, control, "/dev/null", "/dev/random", "/dev/urandom"])
    assert devices.negative == ["/dev/full", "/dev/tty", gpu1, made.alias(1)]
    assert devices.mapped == [gpu0, control, gpu1]
    assert devices.aliases == [(gpu0, made.alias(0)), (gpu1, made.alias(1))]
    assert len(devices.mounts) == 4
    assert devices.environment["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_a_job_without_devices_is_shown_none_of_them(made: gpus.SyntheticGpus) -> None:
    config = load(_configuration(made, made.devices()))
    devices = container.plan_devices(config, [], bundles.resolve(config))
    assert devices.mapped == devices.aliases == devices.mounts == []
    assert devices.environment == {}
    assert devices.negative == ["/dev/zero", "/dev/full", "/dev/tty"]


def test_a_job_holding_both_gpus_shares_the_control_node_once(made: gpus.SyntheticGpus) -> None:
    config = load(_configuration(made, made.devices()))
    devices = container.plan_devices(config, ["gpu0", "gpu1"], bundles.resolve(config))
    names = [(d["name"], d["path"]) for d in devices.prepared if d["name"] != "runtime"]
    assert names == [
        ("gpu0", str(made.gpus[0])),
        ("gpu1", str(made.gpus[1])),
        ("gpu0", str(made.control)),
    ]
    assert devices.negative == ["/dev/tty"]


def test_the_argv_binds_nodes_links_and_files_read_only(made: gpus.SyntheticGpus) -> None:
    config = load(_configuration(made, made.devices()))
    devices = container.plan_devices(config, ["gpu1"], bundles.resolve(config))
    argv = container.run_argv(
        config, podman_driver.SlotAccount(1234, 1234, "/srv/slot"),
        container.AttemptPaths("/srv/slot/ficc/a"), attempt_id="0" * 32, image_id=SHA,
        barrier="/opt/barrier", devices=devices, payload=["/bin/true"], processes=10,
    )  # fmt: skip
    assert f"{made.gpus[1]}:{made.gpus[1]}" in argv
    binding = f"type=bind,source={made.gpus[0]},destination={made.alias(0)},nosuid,noexec"
    assert binding in argv
    assert f"{made.library}:{gpus.LIBRARY_FOLDER}/{gpus.SONAME}:ro,nosuid,nodev" in argv


def test_the_two_written_forms_are_bundles_too(made: gpus.SyntheticGpus) -> None:
    """`{name, path}` is a bundle of one node of a kind of its own; the written form
    names its kind, nodes, shared nodes, files and environment itself."""
    resolved = _resolve(
        made,
        [
            {"name": "render0", "path": str(made.gpus[0])},
            {
                "name": "accel1",
                "kind": "example.com/accel",
                "nodes": [str(made.gpus[1])],
                "shared_nodes": [str(made.control)],
                "mounts": [{"source": str(made.library), "target": "/opt/accel/libaccel.so"}],
                "environment": {"ACCEL": "1"},
            },
        ],
    )
    render, accel = resolved.by_name["render0"], resolved.by_name["accel1"]
    assert (render.kind, [n.path for n in render.nodes], render.shared) == (
        "render0",
        [str(made.gpus[0])],
        (),
    )
    assert [m.target for m in accel.mounts] == ["/opt/accel/libaccel.so"]
    assert resolved.grant(["render0"]).others == []  # its kind has no other device


# --- every refusal, with its code ---------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[Spec], None]:
    """A change of the spec at a dotted path (`containerEdits.hooks`)."""

    def change(spec: Spec) -> None:
        *parents, last = path.split(".")
        target: Any = spec
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[last] = value

    return change


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (_set("cdiVersion", "9.9.9"), "cdi_version"),
        (_set("annotations", {"a": "b"}), "cdi_version"),  # a 0.6.0 field in a 0.5.0 spec
        (_set("surprise", 1), "cdi_invalid"),
        (_set("containerEdits.surprise", 1), "cdi_invalid"),
        (_set("kind", "gpu"), "cdi_invalid"),
        (
            _set("containerEdits.hooks.1.args", ["nvidia-cdi-hook", "enable-cuda-compat"]),
            "cdi_hook_unsupported",
        ),
        (
            _set("containerEdits.hooks.1.path", "/usr/local/bin/vendor-setup"),
            "cdi_hook_unsupported",
        ),
        (_set("containerEdits.hooks.1.hookName", "startContainer"), "cdi_hook_unsupported"),
        (
            _set(
                "containerEdits.hooks.2.args",
                ["nvidia-cdi-hook", "chmod", "--mode", "777", "--path", "/dev/dri"],
            ),
            "cdi_hook_unsupported",
        ),
        (
            _set(
                "containerEdits.hooks.2.args",
                ["nvidia-cdi-hook", "chmod", "--mode", "755", "--path", "/usr/lib"],
            ),
            "cdi_hook_unsupported",
        ),
        (
            _set(
                "containerEdits.hooks.0.args",
                ["nvidia-cdi-hook", "create-symlinks", "--link", "libGL.so.1::/usr/lib/libGL.so"],
            ),
            "cdi_hook_unsupported",
        ),  # a link to a file of the image
        (
            _set("containerEdits.mounts.0.options", ["rw", "nosuid", "nodev", "bind"]),
            "cdi_edit_unsupported",
        ),
        (_set("containerEdits.deviceNodes.0.hostPath", "/dev/fuse"), "cdi_edit_unsupported"),
        (_set("containerEdits.deviceNodes.0.permissions", "r"), "cdi_edit_unsupported"),
        (_set("containerEdits.deviceNodes.0.major", 99), "cdi_edit_unsupported"),
        (
            _set("containerEdits.mounts.1.containerPath", "/proc/driver/nvidia"),
            "device_mount_unsafe",
        ),
    ],
)
def test_a_spec_the_provider_cannot_make_exact_is_refused_with_its_code(
    made: gpus.SyntheticGpus, change: Callable[[Spec], None], code: str
) -> None:
    spec = _spec(made)
    change(spec)
    assert _refused(made, spec) == code


@pytest.mark.parametrize("field", ["additionalGids", "intelRdt", "netDevices"])
def test_edits_a_job_is_never_given_are_refused(made: gpus.SyntheticGpus, field: str) -> None:
    spec = _spec(made)
    spec["cdiVersion"] = "1.1.0"
    spec["containerEdits"][field] = {
        "additionalGids": [44],
        "intelRdt": {"closID": "x"},
        "netDevices": [{"hostInterfaceName": "eth1", "name": "eth1"}],
    }[field]
    assert _refused(made, spec) == "cdi_edit_unsupported"


def test_all_and_unknown_devices_are_refused(made: gpus.SyntheticGpus) -> None:
    spec = _spec(made)
    assert _refused(made, spec, "nvidia.com/gpu=all") == "cdi_device_all"
    assert _refused(made, spec, "nvidia.com/gpu=7") == "cdi_device_unknown"
    assert _refused(made, spec, "amd.com/gpu=0") == "cdi_device_unknown"


def test_a_library_two_files_claim_is_refused(made: gpus.SyntheticGpus) -> None:
    """Two different files with one SONAME in one folder: ldconfig would pick one."""
    twin = made.files / "libcuda.so.999.88.78"
    twin.write_bytes(made.library.read_bytes())
    twin.chmod(0o644)
    spec = _spec(made)
    spec["containerEdits"]["mounts"].append(
        {"hostPath": str(twin), "containerPath": f"{gpus.LIBRARY_FOLDER}/{twin.name}",
         "options": ["ro", "nosuid", "nodev", "bind"]}
    )  # fmt: skip
    assert _refused(made, spec) == "cdi_hook_unsupported"


def test_a_yaml_spec_is_refused(made: gpus.SyntheticGpus) -> None:
    path = made.files / "nvidia.yaml"
    path.write_text("cdiVersion: 0.5.0\n")
    path.chmod(0o644)
    with pytest.raises(ProviderError) as refused:
        _resolve(made, [{"name": "gpu0", "cdi": {"spec": str(path), "device": "nvidia.com/gpu=0"}}])
    assert refused.value.code == "cdi_invalid"
    assert "--format=json" in refused.value.message


@pytest.mark.parametrize("how", ["writable", "not-root", "link", "large", "sticky-directory"])
def test_an_unsafe_spec_file_is_refused(made: gpus.SyntheticGpus, how: str) -> None:
    path = Path(_write_spec(made, _spec(made), "unsafe.json"))
    if how == "writable":
        path.chmod(0o666)
    elif how == "not-root":
        os.chown(path, 65534, 65534)
    elif how == "link":
        link = made.files / "link.json"
        link.symlink_to(path)
        path = link
    elif how == "large":
        path.write_bytes(b" " * (4 << 20) + path.read_bytes())
    else:
        path = Path("/tmp") / f"ficc-{os.getpid()}.json"
        path.write_text(json.dumps(_spec(made)))
    try:
        with pytest.raises(ProviderError) as refused:
            _resolve(
                made, [{"name": "g", "cdi": {"spec": str(path), "device": "nvidia.com/gpu=0"}}]
            )
    finally:
        if how == "sticky-directory":
            path.unlink()
    assert refused.value.code == "cdi_file_unsafe"


@pytest.mark.parametrize("how", ["not-a-node", "block", "link", "group-only"])
def test_a_node_that_is_not_an_open_character_node_is_refused(
    made: gpus.SyntheticGpus, root_dir: Path, how: str
) -> None:
    node = root_dir / "node"
    if how == "not-a-node":
        node.write_text("")
    elif how == "block":
        os.mknod(node, 0o666 | stat.S_IFBLK, os.makedev(7, 200))
    elif how == "link":
        node.symlink_to(made.gpus[0])
    else:
        os.mknod(node, 0o660 | stat.S_IFCHR, os.stat("/dev/zero").st_rdev)
    with pytest.raises(ProviderError) as refused:
        _resolve(made, [{"name": "dev", "path": str(node)}])
    assert refused.value.code == "device_node_invalid"


@pytest.mark.parametrize("how", ["writable", "not-root", "link", "socket", "directory"])
def test_a_mount_source_that_is_not_a_root_read_only_file_is_refused(
    made: gpus.SyntheticGpus, root_dir: Path, how: str
) -> None:
    source = root_dir / "libx.so.1"
    if how in ("writable", "not-root"):
        source.write_bytes(b"x")
        source.chmod(0o646 if how == "writable" else 0o644)
        if how == "not-root":
            os.chown(source, 65534, 65534)
    elif how == "link":
        source.symlink_to(made.library)
    elif how == "socket":
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(source))
    else:
        source.mkdir()
    device = {
        "name": "accel0", "kind": "example.com/accel", "nodes": [str(made.gpus[0])],
        "mounts": [{"source": str(source), "target": "/usr/lib/libx.so.1"}],
    }  # fmt: skip
    with pytest.raises(ProviderError) as refused:
        _resolve(made, [device])
    assert refused.value.code == "device_mount_unsafe"


def test_a_socket_the_spec_mounts_can_be_left_out_by_name(made: gpus.SyntheticGpus) -> None:
    """nvidia-ctk mounts nvidia-persistenced's socket when it runs: refused, unless the
    administrator leaves it out (`exclude`), which must name a mount of the spec."""
    server = made.files / "socket"
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(server))
        spec = _spec(made)
        target = "/run/nvidia-persistenced/socket"
        spec["containerEdits"]["mounts"].append(
            {"hostPath": str(server), "containerPath": target,
             "options": ["ro", "nosuid", "nodev", "bind", "noexec"]}
        )  # fmt: skip
        assert _refused(made, spec) == "device_mount_unsafe"
        path = _write_spec(made, spec, "with-socket.json")
        entry = {"spec": path, "device": "nvidia.com/gpu=0", "exclude": [target]}
        resolved = _resolve(made, [{"name": "gpu0", "cdi": entry}])
        assert target not in {m.target for m in resolved.by_name["gpu0"].mounts}
        entry["exclude"] = ["/not/in/the/spec"]
        with pytest.raises(ProviderError) as refused:
            _resolve(made, [{"name": "gpu0", "cdi": entry}])
        assert refused.value.code == "device_conflict"


@pytest.mark.parametrize(
    "devices",
    [
        # one node, two devices
        lambda m: [
            {"name": "a", "kind": "x.io/g", "nodes": [str(m.gpus[0])]},
            {"name": "b", "kind": "x.io/h", "nodes": [str(m.gpus[0])]},
        ],
        # the same numbers under two paths (/dev/zero's)
        lambda m: [{"name": "a", "path": str(m.gpus[0])}, {"name": "b", "path": "/dev/zero"}],
        # one kind, two sets of shared nodes
        lambda m: [
            {
                "name": "a",
                "kind": "x.io/g",
                "nodes": [str(m.gpus[0])],
                "shared_nodes": [str(m.control)],
            },
            {"name": "b", "kind": "x.io/g", "nodes": [str(m.gpus[1])]},
        ],
        # a shared node that is another device's own
        lambda m: [
            {
                "name": "a",
                "kind": "x.io/g",
                "nodes": [str(m.gpus[0])],
                "shared_nodes": [str(m.gpus[1])],
            },
            {"name": "b", "path": str(m.gpus[1])},
        ],
        # the numbers of a runtime device every job gets (/dev/urandom's)
        lambda m: [{"name": "a", "path": str(m.files / "urandom-like")}],
    ],
    ids=["one-node-two-devices", "same-numbers", "shared-differs", "shared-is-own", "runtime"],
)
def test_devices_that_would_let_two_jobs_meet_are_refused(
    made: gpus.SyntheticGpus, devices: Callable[[gpus.SyntheticGpus], list[dict[str, Any]]]
) -> None:
    like = made.files / "urandom-like"
    os.mknod(like, 0o666 | stat.S_IFCHR, os.stat("/dev/urandom").st_rdev)
    like.chmod(0o666)
    config = _configuration(made, devices(made))
    with pytest.raises(ProviderError) as refused:
        podman_driver.configure(config)
    assert refused.value.code == "device_conflict"


def test_a_node_changed_after_configure_is_refused_at_probe(made: gpus.SyntheticGpus) -> None:
    """A driver reload renumbers a node: the resolved bundle no longer holds
    (`device_changed`, with what to do) until the daemon is restarted."""
    driver = podman_driver.configure(_configuration(made, made.devices()))
    driver.bundles.still(["gpu0"])
    os.unlink(made.gpus[0])
    os.mknod(made.gpus[0], 0o666 | stat.S_IFCHR, os.stat("/dev/tty").st_rdev)
    with pytest.raises(ProviderError) as refused:
        driver.bundles.still(["gpu0"])
    assert refused.value.code == "device_changed"
    assert "restart the daemon" in refused.value.message


# --- the SONAME reader ----------------------------------------------------------------------


def test_the_soname_is_read_from_the_dynamic_section(made: gpus.SyntheticGpus) -> None:
    fd = os.open(made.library, os.O_RDONLY)
    try:
        assert elf.soname_of_fd(fd) == gpus.SONAME
    finally:
        os.close(fd)
    for path, expected in (("/etc/passwd", None), ("/bin/sh", None)):
        fd = os.open(os.path.realpath(path), os.O_RDONLY)
        try:
            assert elf.soname_of_fd(fd) == expected
        finally:
            os.close(fd)


def test_a_damaged_library_has_no_soname(root_dir: Path) -> None:
    library = bytearray(gpus.soname_library("libx.so.1"))
    for offset in (0, 16, 32, 54, 64 + 8, 176 + 8, len(library) - 3):
        damaged = bytearray(library)
        damaged[offset : offset + 2] = b"\xff\xff"
        path = root_dir / f"damaged-{offset}"
        path.write_bytes(bytes(damaged))
        fd = os.open(path, os.O_RDONLY)
        try:
            assert elf.soname_of_fd(fd) in (None, "libx.so.1")  # never a wrong name, never raises
        finally:
            os.close(fd)
