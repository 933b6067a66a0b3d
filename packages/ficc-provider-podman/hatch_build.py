"""Build hook: compile the trusted barrier from source into every wheel.

The barrier must be a static executable with no dynamic loader (the payload gate
compares /proc/PID/exe with it, and a dynamic loader or library path could be
swapped under it), so it is built from `csrc/ficc-barrier.c` when the wheel is
built or installed, never shipped prebuilt in the sdist. The wheel is therefore
platform-specific, but not specific to a Python: it holds no CPython extension, so
its tag is `py3-none-<platform>` (for example `py3-none-linux_x86_64`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sysconfig
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "csrc/ficc-barrier.c"
TARGET = "src/ficc_provider_podman/_bin/ficc-barrier"
CFLAGS = ["-static", "-Os", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-s"]


def wheel_platform() -> str:
    """This machine's wheel platform tag: `linux_x86_64`, `linux_aarch64`, ..."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


class BarrierBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = pathlib.Path(self.root)
        out = root / TARGET
        out.parent.mkdir(exist_ok=True)
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("ficc-provider-podman needs a C compiler (apt-get install gcc)")
        subprocess.run([compiler, *CFLAGS, "-o", str(out), str(root / SOURCE)], check=True)
        out.chmod(0o755)
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{wheel_platform()}"
        build_data["artifacts"].append(TARGET)
