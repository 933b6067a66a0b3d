"""The check, step by step; `main()` is what `tools/gpu/check` runs.

1. the machine     root, loop devices, Podman and runc, a compiler: what is missing
2. the GPUs        NVIDIA, AMD or Intel (discover.py), or the synthetic stand-ins
                   (`--dry-run`); none: the no-GPU verdict, exit 2
3. the bundle      resolved by the provider's own code and printed as the prepare
                   result carries it for a job holding the GPU: nodes, mounts, environment
4. the job         through a real daemon (jobs.py): with Podman, else with the test
                   provider; not at all without root or loop devices
5. the verdict     one line: which GPU the job saw, which it was refused, the time

Exit status: 0 the job saw exactly its own GPU, 1 it did not (or the run failed),
2 no GPU is present, 3 something the check needs is missing (it ran what it could).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from ficc_provider_podman import bundles as bundleslib
from ficc_provider_podman import container
from ficc_provider_podman.config import Config
from ficc_provider_podman.errors import ProviderError
from gpucheck import discover, machine, verdict

DEFAULT_BASE = "/var/lib/ficc-gpu-check"
"""On the root disk: /run is often a small `noexec` tmpfs, where the provider's barrier
could not run (the directory is root's, 0755, and left empty after each run)."""
SHA = "sha256:" + "0" * 64


def say(text: str = "") -> None:
    print(text, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/gpu/check", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="lend synthetic stand-in GPUs (real nodes and files), not this host's",
    )
    parser.add_argument(
        "--without-podman",
        action="store_true",
        help="run the job with the test provider even where Podman is installed (the"
        " device policy alone, as on a host without Podman)",
    )
    parser.add_argument("--gpu", type=int, default=0, help="the GPU the job holds (default 0)")
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"the work directory ({DEFAULT_BASE})")
    return parser.parse_args(argv)


@contextlib.contextmanager
def _work(base: str) -> Iterator[Path]:
    """A root-owned directory for this run under `base`, removed after."""
    Path(base).mkdir(mode=0o755, parents=True, exist_ok=True)
    from ficc_testkit.slots import private_directory, remove_tree  # noqa: PLC0415

    work = private_directory(base, "run-")
    try:
        yield work
    finally:
        remove_tree(work)


def _config(devices: list[dict[str, Any]]) -> Config:
    """The provider's configuration with these devices (no image is loaded here)."""
    image = {"digest": SHA, "archive": "/nonexistent", "archive_sha256": SHA, "image_id": SHA}
    return msgspec.convert({"images": [image], "devices": devices}, Config, strict=True)


def _show(config: Config, resolved: bundleslib.Bundles, name: str) -> None:
    """The prepare result's device part for a job holding `name`."""
    devices = container.plan_devices(config, [name], resolved)
    bundle = resolved.by_name[name]
    say(f"   {name}: kind {bundle.kind}, from {bundle.origin}")
    for entry in devices.prepared:
        say(f"   device   {entry['name']:8} {entry['path']} {entry['major']}:{entry['minor']}")
    say(f"   positive {' '.join(devices.positive)}")
    say(f"   negative {' '.join(devices.negative)}")
    for node, alias in devices.aliases:
        say(f"   link     {alias} -> {node}")
    for mount in devices.mounts:
        say(f"   mount    {mount.target} <- {mount.source} (ro, {mount.device}:{mount.inode})")
    for key, value in devices.environment.items():
        say(f"   env      {key}={value}")


def run(args: argparse.Namespace) -> verdict.Verdict:
    started = time.monotonic()
    say("== 1 the machine")
    here = machine.look(without_podman=args.without_podman)
    for why in here.podman_missing:
        say(f"   missing: {why}")
    if not here.podman_missing:
        say("   root, loop devices, podman, runc, a compiler: present")
    if here.root and not args.dry_run:
        found = discover.nvidia(Path("/nonexistent")) or discover.render_nodes()
        if found is None:
            return verdict.no_gpu(discover.absent(), started)
        say(f"   {found.vendor} GPUs: {', '.join(found.names)}; the rest needs root")
        return verdict.not_run(f"gpu{args.gpu}", here.daemon_missing, started)
    if here.root:
        return verdict.not_run(f"gpu{args.gpu}", [here.root], started)
    os.environ.setdefault("FICC_TEST_WORLD_PARENT", args.base)
    with _work(args.base) as work, _gpus(args, work) as found:
        if found is None:
            say("== 2 the GPUs")
            return verdict.no_gpu(discover.absent(), started)
        return _lend(args, here, found, started)


@contextlib.contextmanager
def _gpus(args: argparse.Namespace, work: Path) -> Iterator[discover.Found | None]:
    if not args.dry_run:
        yield discover.nvidia(work) or discover.render_nodes()
        return
    from ficc_testkit import gpus  # noqa: PLC0415

    with gpus.synthetic_gpus(str(work)) as made:
        notes = [f"stand-ins: {', '.join(map(str, made.gpus))}, shared {made.control};"
                 f" CDI spec {made.spec}"]  # fmt: skip
        yield discover.Found("synthetic", made.devices(("gpu0", "gpu1")), notes)


def _lend(
    args: argparse.Namespace, here: machine.Machine, found: discover.Found, started: float
) -> verdict.Verdict:
    say("== 2 the GPUs")
    say(f"   {found.vendor}: {', '.join(found.names)}")
    for note in found.notes:
        say(f"   {note}")
    name = f"gpu{args.gpu}"
    if name not in found.names:
        say(f"   there is no {name}: choose one with --gpu")
        return verdict.Verdict("fail", verdict.FAIL, f"VERDICT fail: no {name} on this host")
    say("== 3 the bundle (as the prepare result carries it)")
    config = _config(found.devices)
    try:
        resolved = bundleslib.resolve(config)
    except ProviderError as refused:
        say(f"   refused: {refused.code}: {refused.message}")
        return verdict.Verdict(
            "fail", verdict.FAIL, f"VERDICT fail: {refused.code} {verdict.stamp(started)}"
        )
    _show(config, resolved, name)
    say("== 4 the job")
    if here.daemon_missing:
        say(f"   not run: missing {'; '.join(here.daemon_missing)}")
        return verdict.not_run(name, here.daemon_missing, started)
    from gpucheck import jobs  # noqa: PLC0415 (reads FICC_TEST_WORLD_PARENT when imported)

    if here.podman_missing:
        say("   with the test provider (Podman cannot run here): device policy only")
        grant = resolved.grant([name])
        nodes = {name: [node.path for _, node in (*grant.own, *grant.shared)]}
        observed = jobs.with_test_provider(
            args.base, nodes, [node.path for node in grant.others], name
        )
    else:
        say("   in a rootless Podman container, through the daemon")
        driver_files = {m.source for m in resolved.by_name[name].mounts}
        query = next((p for p in found.programs if "deviceQuery" in p.name), None)
        image_files = jobs.host_libraries(found.programs, driver_files)
        observed = jobs.with_podman(found.devices, name, image_files, query)
    say(f"   runner: {observed.runner}; the attempt ended {observed.state} ({observed.reason})")
    for path, opened in observed.opened.items():
        say(f"   {'opened ' if opened else 'refused'} {path}")
    for line in observed.smi:
        say(f"   nvidia-smi -L: {line}")
    for line in observed.query:
        say(f"   deviceQuery: {line}")
    say("== 5 the verdict")
    return verdict.judge(
        name, resolved, observed.opened, ran=not here.podman_missing, ended=observed.state,
        smi=observed.smi, started=started,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    say(f"ficc GPU check{' (dry run: synthetic stand-in GPUs)' if args.dry_run else ''}")
    try:
        result = run(args)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    say(result.line)
    return result.status


if __name__ == "__main__":
    sys.exit(main())
