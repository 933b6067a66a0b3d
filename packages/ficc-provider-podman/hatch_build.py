"""Build hook: compile the trusted barrier from source into every wheel.

The barrier must be a static executable with no dynamic loader (the payload gate
compares /proc/PID/exe with it, and a dynamic loader or library path could be
swapped under it), so it is built from `csrc/ficc-barrier.c` when the wheel is
built or installed, never shipped prebuilt in the sdist. The wheel is therefore
platform-specific.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "csrc/ficc-barrier.c"
TARGET = "src/ficc_provider_podman/_bin/ficc-barrier"
CFLAGS = ["-static", "-Os", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-s"]


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
        build_data["infer_tag"] = True
        build_data["artifacts"].append(TARGET)
