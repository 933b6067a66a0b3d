"""Developer tasks for the ficc monorepo; nox is the single entry point.

Sessions:
  unit                                 the fast lane: every package's tests that need no root and
                                       no Podman (pure logic and codecs); first in CI, where it
                                       runs a second time as an account without privileges
  unit_unprivileged                    the fast lane as `nobody`, from a copy of the checkout
  hoststate, protocol, executor_host,
  provider_podman                      one distribution's own tests
  integration                          tests that cross distributions (tests-integration/)
  conformance                          the provider conformance kit on both providers (also
                                       part of integration)
  systemd                              the systemd backend under real systemd in a container
  systemd_unified                      systemd's v2 device programs, systemd in unified mode
  vm                                   the production host under qemu: deploy, v2 suites,
                                       one reboot and one power cut (tools/vm)
  vm_soak                              `-- --cuts N --seed S`: N power cuts
  lint                                 ruff
  typecheck                            mypy --strict on every src/
  build                                wheel + sdist of every distribution, each installed alone
                                       and every module of it imported
  upgrade                              the previous release upgraded in place to this build
  release                              `-- DIST VERSION`: check, test the wheel, tag, build
  bench                                the benchmarks (tools/bench), as ratios
  soak                                 the long reliability loops (R1, R3 at soak size)
  demo                                 one real job end to end (tools/demo.py)
  gpu_check                            tools/gpu/check against the built wheels (`-- --dry-run`
                                       where there is no GPU)
  ci                                   everything CI needs: all of the above but bench, soak,
                                       vm_soak, demo

`nox -s ci` is what the README's test command runs (`tools/dev test`); `.ci/run` runs
`tools/dev setup`, then that command.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import re
import shutil
import subprocess
import tempfile
import tomllib
import zipfile

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["ci"]

ROOT = pathlib.Path(__file__).parent
PACKAGES = ROOT / "packages"

# Distributions in dependency order: each may depend only on those before it.
DISTRIBUTIONS = [
    "ficc-hoststate",
    "ficc-protocol",
    "ficc-provider-sdk",
    "ficc-executor-host",
    "ficc-provider-podman",
]

# hatchling: tests build real wheels (the test provider) without reaching an index.
# jsonschema: a real JSON Schema validator checks the published vectors (tests only);
# prometheus_client: only its text parser, to read the daemon's metrics as Prometheus would.
TEST_TOOLS = [
    "pytest>=8",
    "hypothesis>=6.100",
    "hatchling>=1.27",
    "psutil>=5.9",
    "jsonschema>=4.18",
    "prometheus_client>=0.17",
]
LINT_TOOLS = ["ruff>=0.6"]
TYPE_TOOLS = ["mypy>=1.10"]
BUILD_TOOLS = ["hatchling>=1.27"]


# Never released: the shared test machinery (the `root` and `podman` markers), installed
# into every test environment and into no release.
TESTKIT = PACKAGES / "ficc-testkit"
# The tests `nox -s unit` leaves out; CI runs them after it, so each test runs once.
OUTSIDE_THE_FAST_LANE = "root or podman or slow or soak"
# Distributions all of whose tests are in the fast lane (pure code, no root, no Podman).
FAST_LANE_ONLY = {"ficc-provider-sdk"}


def _present() -> list[str]:
    """Distributions that exist in this checkout (a pyproject.toml is the marker)."""
    return [name for name in DISTRIBUTIONS if (PACKAGES / name / "pyproject.toml").exists()]


def _install_all(session: nox.Session) -> None:
    session.install(*TEST_TOOLS, f"-e{TESTKIT}")
    session.install(*[f"-e{PACKAGES / name}" for name in _present()])


def _pytest(session: nox.Session, target: pathlib.Path, *extra: str) -> None:
    """Run one test tree; an empty or missing tree is a failure, not a pass."""
    if not target.exists():
        session.error(f"test tree {target} is missing")
    session.run("pytest", "-q", "-ra", "--durations=10", str(target), *extra, *session.posargs)


def _package_tests(session: nox.Session, name: str) -> None:
    _pytest(session, PACKAGES / name / "tests")


def _integration_tests(session: nox.Session) -> None:
    tests = sorted((ROOT / "tests-integration").glob("test_*.py"))
    if not tests:
        session.log("tests-integration/ has no tests yet; nothing crosses distributions")
        return
    _pytest(session, ROOT / "tests-integration")


def _lint(session: nox.Session) -> None:
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


def _typecheck(session: nox.Session) -> None:
    for name in [*_present(), TESTKIT.name]:
        src = PACKAGES / name / "src"
        session.run(
            "mypy",
            "--strict",
            "--namespace-packages",
            "--explicit-package-bases",
            str(src),
            env={"MYPYPATH": str(src)},
        )


def _build_dist(session: nox.Session) -> pathlib.Path:
    """Every distribution's wheel and sdist, afresh in dist/."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in _present():
        with session.chdir(PACKAGES / name):
            session.run("hatchling", "build", "-t", "wheel", "-t", "sdist", "-d", str(dist))
    return dist


def _build(session: nox.Session) -> None:
    """Build every wheel and sdist, then prove each wheel installs and imports alone."""
    dist = _build_dist(session)
    for name in _present():
        _check_wheel_alone(session, dist, name)


def _wheel_of(dist: pathlib.Path, name: str) -> pathlib.Path:
    (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    return wheel


def wheel_modules(wheel: pathlib.Path) -> list[str]:
    """Every importable module a wheel installs (from its file list, not its source)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    modules = []
    for path in names:
        top = path.split("/", 1)[0]
        if not path.endswith(".py") or top.endswith((".dist-info", ".data")):
            continue
        parts = path[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return sorted(modules)


def source_modules(name: str) -> list[str]:
    """Every module under the distribution's src/ (what its wheel must contain)."""
    src = PACKAGES / name / "src"
    modules = []
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return modules


_IMPORT_ALL = """
import importlib, sys
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
print(f"imported all {len(names)} modules of the wheel")
"""


def _check_wheel_alone(session: nox.Session, dist: pathlib.Path, name: str) -> None:
    """Install one wheel (plus the wheels it needs from this repo) into a fresh venv and
    import every module it contains: a wheel that misses a module fails here."""
    wheel = _wheel_of(dist, name)
    modules = wheel_modules(wheel)
    missing = sorted(set(source_modules(name)) - set(modules))
    if missing or not modules:
        session.error(f"{wheel.name} lacks modules of its source tree: {missing or 'all'}")
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp) / "venv"
        session.run("python", "-m", "venv", str(venv))
        py = str(venv / "bin" / "python")
        session.run(py, "-m", "pip", "install", "-q", "--find-links", str(dist), str(wheel))
        with session.chdir(tmp):  # not the repository: only the installed wheel is importable
            session.run(py, "-I", "-c", _IMPORT_ALL, *modules)


def _unit_tests(session: nox.Session) -> None:
    """Each package's tests that carry none of the `root`, `podman`, `slow` and `soak` markers,
    and the test kit's own (all pure)."""
    for name in _present():
        _pytest(session, PACKAGES / name / "tests", "-m", f"not ({OUTSIDE_THE_FAST_LANE})")
    _pytest(session, TESTKIT / "tests")


@nox.session
def unit(session: nox.Session) -> None:
    """The fast lane: pure logic and codecs, no root and no Podman needed."""
    _install_all(session)
    _unit_tests(session)


@nox.session
def hoststate(session: nox.Session) -> None:
    """ficc-hoststate's own tests."""
    _install_all(session)
    _package_tests(session, "ficc-hoststate")


@nox.session
def protocol(session: nox.Session) -> None:
    """ficc-protocol's own tests."""
    _install_all(session)
    _package_tests(session, "ficc-protocol")


@nox.session(name="executor_host")
def executor_host(session: nox.Session) -> None:
    """ficc-executor-host's own tests."""
    _install_all(session)
    _package_tests(session, "ficc-executor-host")


@nox.session(name="provider_podman")
def provider_podman(session: nox.Session) -> None:
    """ficc-provider-podman's own tests (real rootless Podman)."""
    _install_all(session)
    _package_tests(session, "ficc-provider-podman")


@nox.session
def systemd(session: nox.Session) -> None:
    """The systemd backend under real systemd as PID 1 (tools/systemd/run.py).

    A debootstrap rootfs (cached in /var/cache/ficc-systemd-rootfs) is booted in a
    privileged Podman container, the project's wheels are installed there offline and
    the backend's behaviour tests run inside. Needs root, Podman and a Debian mirror.
    """
    session.install(*BUILD_TOOLS)
    session.run("python", str(ROOT / "tools" / "systemd" / "run.py"), *session.posargs)


@nox.session
def systemd_unified(session: nox.Session) -> None:
    """systemd's cgroup v2 device programs under real systemd booted in unified mode
    (tools/systemd/unified.py; the same rootfs, lock and cleanup as `systemd`)."""
    session.install(*BUILD_TOOLS)
    session.run("python", str(ROOT / "tools" / "systemd" / "unified.py"), *session.posargs)


@nox.session
def vm(session: nox.Session) -> None:
    """The production host: Debian 12 under qemu with systemd as PID 1 and a unified
    cgroup v2 tree, deployed by docs/operations.md, the v2 suites run inside, one
    reboot and one power cut (tools/vm/run.py; its options after `--`)."""
    session.install(*BUILD_TOOLS)
    session.run("python", str(ROOT / "tools" / "vm" / "run.py"), *session.posargs)


@nox.session(name="vm_soak")
def vm_soak(session: nox.Session) -> None:
    """Power cuts at seeded random moments: `nox -s vm_soak -- --cuts N --seed S`
    (no suites; each cut is checked after the next boot)."""
    session.install(*BUILD_TOOLS)
    session.run("python", str(ROOT / "tools" / "vm" / "run.py"), "--suites", "", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Tests that cross distributions: real daemon, real socket, real provider."""
    _install_all(session)
    _integration_tests(session)


@nox.session
def conformance(session: nox.Session) -> None:
    """The provider conformance kit on the test provider and the Podman provider, and
    on a deliberately broken provider (part of `integration`, so of `ci`)."""
    _install_all(session)
    _pytest(session, ROOT / "tests-integration" / "test_conformance.py")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole tree."""
    session.install(*LINT_TOOLS)
    _lint(session)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every distribution's src/."""
    _install_all(session)
    session.install(*TYPE_TOOLS)
    _typecheck(session)


@nox.session
def build(session: nox.Session) -> None:
    """Wheel and sdist for every distribution; each wheel installs and imports alone."""
    session.install(*BUILD_TOOLS)
    _build(session)


@nox.session
def dist(session: nox.Session) -> None:
    """The wheels (and sdists) an administrator installs, in dist/ (docs/operations.md)."""
    session.install(*BUILD_TOOLS)
    built = _build_dist(session)
    for wheel in sorted(built.glob("*.whl")):
        session.log(f"built {wheel}")
    session.log(f"copy {built}/*.whl to each host and install them (docs/operations.md, 2.)")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks of docs/benchmarks.md as ratios against baselines measured in the same run.

    `nox -s bench -- --json FILE` also writes the figures as JSON.
    """
    _install_all(session)
    session.run("python", str(ROOT / "tools" / "bench" / "run.py"), *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """The long reliability loops: the same tests with soak-sized counts."""
    _install_all(session)
    env = {"FICC_SOAK": "1"}
    for name in _present():
        session.run(
            "pytest",
            "-q",
            "-ra",
            "-m",
            "soak",
            str(PACKAGES / name / "tests"),
            env=env,
            success_codes=[0, 5],
        )
    session.run(
        "pytest",
        "-q",
        "-ra",
        "-m",
        "soak",
        str(ROOT / "tests-integration"),
        env=env,
        success_codes=[0, 5],
    )


def _install_built_wheels(session: nox.Session) -> list[str]:
    """The test tools, then every distribution from its built wheel (not the source
    tree): the package tests then test what a release ships. Returns the wheels."""
    session.install(*TEST_TOOLS, *BUILD_TOOLS, str(TESTKIT))
    dist = pathlib.Path(session.create_tmp()).resolve() / "wheels"
    shutil.rmtree(dist, ignore_errors=True)
    for name in _present():
        with session.chdir(PACKAGES / name):
            session.run("hatchling", "build", "-t", "wheel", "-d", str(dist))
    wheels = [str(_wheel_of(dist, name)) for name in _present()]
    session.install("--find-links", str(dist), *wheels)
    return wheels


UNPRIVILEGED_ACCOUNT = "nobody"
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3 (tools/dev installs it)


def _unit_tests_unprivileged(session: nox.Session, wheels: list[str]) -> None:
    """The fast lane again, as an account without privileges (run as root).

    A fast-lane test that needs root without saying so (a file it expects root to own,
    a chown) passes as root and fails on a contributor's machine; here it fails CI.
    The account cannot read this session's environment or checkout when they live
    under a private home (pyenv under /root), so the tests run from a copy of the
    checkout's tracked files (`git add` a new test first) in a world-readable
    temporary directory, in a virtual environment of the system's Python holding the
    same wheels, with an environment of their own (nothing of root's is passed on).
    """
    account = pwd.getpwnam(UNPRIVILEGED_ACCOUNT)
    version = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import ensurepip, sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if version.returncode != 0 or tuple(map(int, version.stdout.split("."))) < (3, 11):
        session.error(
            f"{SYSTEM_PYTHON} with venv (3.11 or newer) runs the fast lane as"
            f" {UNPRIVILEGED_ACCOUNT}: install Debian's python3 and python3-venv"
            f" ({version.stdout.strip() or version.stderr.strip()})"
        )
    session.log(f"the fast lane as {UNPRIVILEGED_ACCOUNT}, on Python {version.stdout.strip()}")
    listed = _git("ls-files", "-z", "--cached")
    with tempfile.TemporaryDirectory(prefix="ficc-unprivileged-") as tmp:
        base = pathlib.Path(tmp)
        tree, venv = base / "tree", base / "venv"
        for name in filter(None, listed.split("\0")):
            if (ROOT / name).is_file():
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, tree / name)
        session.run(SYSTEM_PYTHON, "-m", "venv", str(venv), external=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        testkit = tree / TESTKIT.relative_to(ROOT)
        session.run(*pip, *TEST_TOOLS, str(testkit), *wheels, external=True)
        for path in [base, *base.rglob("*")]:
            if not path.is_symlink():  # readable, and executable where the owner's is
                mode = path.stat().st_mode
                path.chmod(mode | (0o555 if path.is_dir() or mode & 0o100 else 0o444))
        home = base / "home"  # the account's only writable place (hypothesis keeps its examples)
        home.mkdir()
        os.chown(home, account.pw_uid, account.pw_gid)
        as_account = [
            "setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}",
            "--clear-groups", "env", "-i", f"HOME={home}", f"PATH={venv / 'bin'}:/usr/bin:/bin",
            "LANG=C.UTF-8", "TMPDIR=/tmp", f"FICC_CI={os.environ.get('FICC_CI', '')}",
            str(venv / "bin" / "python"), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        ]  # fmt: skip
        targets = [tree / "packages" / name / "tests" for name in _present()]
        for target in [*targets, testkit / "tests"]:
            if not target.is_dir():
                session.error(f"test tree {target} is missing from the copy")
        with session.chdir(home):
            for target in targets:
                session.run(*as_account, str(target), "-m", f"not ({OUTSIDE_THE_FAST_LANE})",
                            *session.posargs, external=True)  # fmt: skip
            session.run(*as_account, str(testkit / "tests"), *session.posargs, external=True)


@nox.session(name="unit_unprivileged")
def unit_unprivileged(session: nox.Session) -> None:
    """The fast lane as an account without privileges (run as root; see CI)."""
    if os.geteuid() != 0:
        session.error("run as root: the session itself switches to the unprivileged account")
    _unit_tests_unprivileged(session, _install_built_wheels(session))


@nox.session
def ci(session: nox.Session) -> None:
    """Everything CI runs, cheapest first, stopping at the first failure: lint,
    typecheck, every package's fast lane against the installed wheels, then the tests
    that need root or Podman, integration, systemd, the VM lane (a production host:
    its `--ci` suites, reboot and power cut), upgrade, build."""
    wheels = _install_built_wheels(session)
    session.install(*LINT_TOOLS, *TYPE_TOOLS)
    os.environ.setdefault("FICC_CI", "1")
    # first: a lint or type error, or a broken codec, fails the run in a minute or two
    _lint(session)
    _typecheck(session)
    _unit_tests(session)
    if os.geteuid() == 0:  # otherwise the fast lane above already ran without root
        _unit_tests_unprivileged(session, wheels)
    for name in _present():
        if name not in FAST_LANE_ONLY:
            _pytest(session, PACKAGES / name / "tests", "-m", OUTSIDE_THE_FAST_LANE)
    _integration_tests(session)
    session.run("python", str(ROOT / "tools" / "systemd" / "run.py"))
    session.run("python", str(ROOT / "tools" / "systemd" / "unified.py"))
    session.run("python", str(ROOT / "tools" / "vm" / "run.py"), "--ci")
    _upgrade(session)
    _build(session)


@nox.session
def demo(session: nox.Session) -> None:
    """One real job through the daemon and the Podman provider, step by step."""
    script = ROOT / "tools" / "demo.py"
    _install_all(session)
    session.install(*BUILD_TOOLS)
    session.run("python", str(script), *session.posargs)


@nox.session(name="gpu_check")
def gpu_check(session: nox.Session) -> None:
    """Whether a job sees exactly the GPU it was lent (tools/gpu/check, its options after
    `--`), with the daemon and the provider from the built wheels."""
    _install_built_wheels(session)
    session.run("python", str(ROOT / "tools" / "gpu" / "check"), *session.posargs)


# --- releases ----------------------------------------------------------------------------------


def project_version(name: str) -> str:
    """The one place a distribution's version lives: `version` in its pyproject.toml."""
    with open(PACKAGES / name / "pyproject.toml", "rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def changelog_has(name: str, version: str) -> bool:
    """Whether the distribution's CHANGELOG.md has a `## VERSION` heading (no `unreleased`)."""
    text = (PACKAGES / name / "CHANGELOG.md").read_text()
    heading = re.compile(rf"^## {re.escape(version)}(?: \(\d{{4}}-\d\d-\d\d\))?\s*$", re.MULTILINE)
    return heading.search(text) is not None


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _release_checks(session: nox.Session, name: str, version: str) -> None:
    if name not in _present():
        session.error(f"{name!r} is not a distribution here; one of {', '.join(_present())}")
    if _git("status", "--porcelain", "--untracked-files=normal").strip():
        session.error("the working tree is not clean: commit or stash first")
    if project_version(name) != version:
        session.error(
            f"packages/{name}/pyproject.toml says version {project_version(name)}, not "
            f"{version}: set it there (the one place it lives) and commit"
        )
    if not changelog_has(name, version):
        session.error(
            f"packages/{name}/CHANGELOG.md has no '## {version}' heading: say what a user of "
            "this release must know, and commit"
        )
    tag = f"{name}-v{version}"
    if _git("tag", "--list", tag).strip():
        session.error(f"tag {tag} exists already")


@nox.session
def release(session: nox.Session) -> None:
    """`nox -s release -- DIST VERSION`: check, test the built wheel, tag, leave it in dist/.

    Refuses unless the tree is clean, DIST's pyproject.toml has VERSION and its
    CHANGELOG.md a `## VERSION` heading. Builds DIST's wheel and sdist into dist/, runs
    DIST's tests against the installed wheel (the other distributions it needs are
    built from this same commit), and only then tags the commit `DIST-vVERSION`.
    """
    if len(session.posargs) != 2:
        session.error("usage: nox -s release -- DISTRIBUTION VERSION")
    name, version = session.posargs
    _release_checks(session, name, version)
    session.install(*TEST_TOOLS, *BUILD_TOOLS, str(TESTKIT))
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    for stale in dist.glob(f"{name.replace('-', '_')}-*"):
        stale.unlink()
    with session.chdir(PACKAGES / name):
        session.run("hatchling", "build", "-t", "wheel", "-t", "sdist", "-d", str(dist))
    needed = pathlib.Path(session.create_tmp()).resolve() / "needed"
    shutil.rmtree(needed, ignore_errors=True)
    for other in _present()[: _present().index(name)]:
        with session.chdir(PACKAGES / other):
            session.run("hatchling", "build", "-t", "wheel", "-d", str(needed))
    wheel = _wheel_of(dist, name)
    session.install("--find-links", str(needed), "--force-reinstall", str(wheel))
    with session.chdir(session.create_tmp()):  # only the installed wheel is importable
        session.run("python", "-I", "-c", _IMPORT_ALL, *wheel_modules(wheel))
    session.run("pytest", "-q", "-ra", str(PACKAGES / name / "tests"))
    _git("tag", "-a", f"{name}-v{version}", "-m", f"{name} {version}")
    session.log(f"tagged {name}-v{version}; {wheel.name} and its sdist are in {dist}")


# --- upgrades ------------------------------------------------------------------------------

UPGRADE_BASELINE = "732eae8c971d9cabc8544a4ad8722bee12f3b31c"
"""The commit whose wheels stand for "the previous release" until a release tag exists."""


def previous_release() -> str:
    """The newest `ficc-executor-host-v*` tag, else UPGRADE_BASELINE."""
    tags = _git("tag", "--list", "ficc-executor-host-v*", "--sort=-v:refname").split()
    return tags[0] if tags else UPGRADE_BASELINE


def _ensure_commit(ref: str) -> None:
    """Fetch `ref` when a shallow checkout (as CI makes) does not have it."""
    probe = ["git", "cat-file", "-e", f"{ref}^{{commit}}"]
    if subprocess.run(probe, cwd=ROOT, check=False, capture_output=True).returncode != 0:
        _git("fetch", "--no-tags", "--depth=1", "origin", ref)


def _build_wheels(session: nox.Session, tree: pathlib.Path, out: pathlib.Path) -> None:
    """The host's wheels as `tree` has them (an older tree may lack the provider SDK)."""
    for name in ("ficc-protocol", "ficc-provider-sdk", "ficc-executor-host"):
        if not (tree / "packages" / name / "pyproject.toml").exists():
            continue
        with session.chdir(tree / "packages" / name):
            session.run("hatchling", "build", "-t", "wheel", "-d", str(out))


def _venv(session: nox.Session, where: pathlib.Path, *install: str, base: str = "python") -> str:
    """A root-owned virtualenv of the `base` interpreter, readable by other accounts."""
    session.run(base, "-m", "venv", str(where), external=True)
    os.chmod(where, 0o755)  # noqa: S103 - the transport account must read it
    python = str(where / "bin" / "python")
    session.run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                *install, external=True)  # fmt: skip
    return python


@nox.session
def upgrade(session: nox.Session) -> None:
    """The previous release upgraded in place to this build (tools/upgrade/).

    Builds the previous release's ficc-protocol and ficc-executor-host wheels (the
    newest release tag, or UPGRADE_BASELINE) and this tree's, makes a virtualenv with
    the old host (to be upgraded in place by the test) and one with only the old
    ficc-protocol (a controller that has not upgraded), then runs
    tools/upgrade/test_upgrade.py. Needs root.
    """
    _install_all(session)
    session.install(*BUILD_TOOLS)
    _upgrade(session)


def _upgrade(session: nox.Session) -> None:
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="ficc-upgrade-", dir="/run"))
    os.chmod(scratch, 0o755)  # noqa: S103 - the transport account must traverse it
    try:
        baseline = previous_release()
        old_tree, old, new = scratch / "old-tree", scratch / "old", scratch / "new"
        old_tree.mkdir()
        _ensure_commit(baseline)
        archive = subprocess.run(["git", "archive", baseline], cwd=ROOT, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        session.log(f"previous release: {baseline}")
        _build_wheels(session, old_tree, old)
        _build_wheels(session, ROOT, new)
        # The administrator's wheelhouse: the new wheels and everything they depend on
        # (a release may add a dependency), installed from it with --no-index.
        session.run("python", "-m", "pip", "download", "-q", "--disable-pip-version-check",
                    "--dest", str(new), "--find-links", str(new),
                    *[str(w) for w in sorted(new.glob("*.whl"))])  # fmt: skip
        old_wheels = [str(w) for w in sorted(old.glob("*.whl"))]
        (protocol_wheel,) = old.glob("ficc_protocol-*.whl")
        host = _venv(session, scratch / "host", "--find-links", str(old), *old_wheels)
        # The controller runs as the transport account: its interpreter must be one
        # every account can read (the system's), not one under root's home.
        system = shutil.which("python3", path="/usr/bin:/bin") or "python"
        controller = _venv(session, scratch / "controller", str(protocol_wheel), base=system)
        env = {
            "FICC_UPGRADE_HOST_PYTHON": host,
            "FICC_UPGRADE_NEW_WHEELS": str(new),
            "FICC_UPGRADE_CONTROLLER_PYTHON": controller,
            "FICC_UPGRADE_OLD_PROVIDER": str(
                old_tree / "tests-integration" / "providers" / "ficc-test-provider"
            ),
        }
        session.run("pytest", "-q", "-ra", str(ROOT / "tools" / "upgrade"), *session.posargs,
                    env=env)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
