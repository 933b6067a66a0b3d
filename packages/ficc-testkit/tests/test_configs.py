"""The configuration the kit writes is one the daemon's own parser reads back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config
from ficc_testkit import configs
from ficc_testkit.accounts import Account
from ficc_testkit.digests import fake
from ficc_testkit.slots import SlotFilesystem

UUID = "0b3a3e1c-3f6b-4f3a-9e1e-0123456789ab"


def _config(**overrides: object) -> Config:
    base = Path("/run/kit")
    slot_account = Account("kit-slot", 1002, 1002)
    filesystem = SlotFilesystem(base / "slots" / "s0", base / "s0.img", UUID, 64 << 20)
    return configs.host_config(
        base,
        transport=Account("kit-transport", 1000, 1000),
        owners=[Account("kit-owner", 1001, 1001)],
        slots=[configs.slot(0, filesystem, slot_account, slot_class="small", storage_inodes=9)],
        resources=configs.allowance(
            cpu_millis=1000,
            memory_bytes=1 << 30,
            processes=64,
            slots=1,
            projects=["3" * 32],
            runtimes=["test"],
        ),
        providers=[configs.provider("test", fake(), {"runtime": "service"})],
        **overrides,
    )


def _parsed(document: dict[str, object]) -> Config:
    return parse_config(json.dumps(document).encode(), ".json")


def test_the_encoded_config_parses_back_to_the_same_config() -> None:
    config = _config()
    assert _parsed(configs.encode_config(config)) == config


def test_keys_left_at_their_default_are_not_written() -> None:
    document = configs.encode_config(_config())
    defaults = {
        f.encode_name for f in msgspec.structs.fields(Config) if f.default is not msgspec.NODEFAULT
    }
    assert defaults
    assert not defaults & document.keys()


def test_an_override_is_written_and_read_back() -> None:
    config = _config(ledger_max_bytes=2 << 20, maximum_lease_seconds=3)
    document = configs.encode_config(config)
    assert (document["ledger_max_bytes"], document["maximum_lease_seconds"]) == (2 << 20, 3)
    assert _parsed(document) == config


def test_an_unknown_override_is_refused() -> None:
    with pytest.raises(TypeError):
        _config(no_such_key=1)


def test_the_offer_is_the_ceiling_under_its_control() -> None:
    config = _config()
    offer = msgspec.structs.asdict(config.initial_offer)
    assert offer.pop("control") == "active"
    assert offer == msgspec.structs.asdict(config.ceiling)


def test_fresh_identities_for_every_config() -> None:
    first, second = _config(), _config()
    assert first.installation_id != second.installation_id
    assert first.deployment_id != second.deployment_id
    assert first.node_id != second.node_id
