"""Print the host's configuration as TOML, in the shape of docs/configuration.md's
example (written by hand on a real host; here from the values the guide's commands
printed: the pin, the image entry and each slot's entry).

    python3 write_config.py --digest sha256:... --image image.json --slot slot-0.json ...

Runs under the guest's system Python with no dependencies (it is part of the
administrator's work, not of the daemon).
"""

from __future__ import annotations

import argparse
import json
import pwd
import secrets
from typing import Any

PROJECT = "3123456789abcdef0123456789abcdef"
"""The one project this lane's controller runs jobs for (the guide's example value)."""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for these ASCII values
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--digest", required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--slot", action="append", required=True)
    args = parser.parse_args()
    with open(args.image) as file:
        image = json.load(file)
    top = {
        "installation_id": secrets.token_hex(16),
        "deployment_id": "1123456789abcdef0123456789abcdef",
        "node_id": secrets.token_hex(16),
        "mode": "managed",
        "transport_uid": pwd.getpwnam("ficc-transport").pw_uid,
        "local_owner_uids": [],
        "maximum_lease_seconds": 600,
        "state_dir": "/var/lib/ficc-executor",
        "socket_dir": "/run/ficc-executor",
        "supervisor": "auto",
    }
    for key, value in top.items():
        print(f"{key} = {toml_value(value)}")
    for index, path in enumerate(args.slot):
        with open(path) as file:
            entry = json.load(file)["slot"]
        account = pwd.getpwnam(f"ficc-slot-{index}")
        slot = {
            "id": f"small-{index}",
            "class": "small",
            "generation": 1,
            "path": entry["path"],
            "uid": account.pw_uid,
            "gid": account.pw_gid,
            "storage_bytes": entry["storage_bytes"],
            "storage_inodes": entry["storage_inodes"],
            "filesystem_uuid": entry["filesystem_uuid"],
        }
        print("\n[[slots]]")
        for key, value in slot.items():
            print(f"{key} = {toml_value(value)}")
    limits = {"cpu_millis": 2000, "memory_bytes": 1 << 30, "swap_bytes": 0, "processes": 1024}
    print("\n[ceiling]")
    for key, value in {**limits, "slots": len(args.slot), "devices": [],
                       "projects": [PROJECT], "runtimes": ["podman"]}.items():  # fmt: skip
        print(f"{key} = {toml_value(value)}")
    print("\n[initial_offer]")
    for key, value in {"control": "active", **limits, "slots": len(args.slot), "devices": [],
                       "projects": [PROJECT], "runtimes": ["podman"]}.items():  # fmt: skip
        print(f"{key} = {toml_value(value)}")
    print('\n[[providers]]\nid = "podman"')
    print(f"package_digest = {toml_value(args.digest)}")
    print("\n[[providers.configuration.images]]")
    for key, value in image.items():
        print(f"{key} = {toml_value(value)}")


if __name__ == "__main__":
    main()
