"""The storage half of the removal proof, on containers-storage files written here.

The whole proof runs against real Podman in test_driver.py; these cases are the ones
real Podman does not produce on demand: a layer left without its container, a newer
Podman's volatile records, a link where a directory should be, unreadable records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ficc_provider_podman import removal
from ficc_provider_podman.account import SlotAccount

CID = "c" * 64
IMAGE_LAYERS = {"base": "", "top": "base"}


def _write(storage: Path, below: tuple[str, str], value: object) -> None:
    (storage / below[0]).mkdir(parents=True, exist_ok=True)
    (storage / below[0] / below[1]).write_text(json.dumps(value))


@pytest.fixture
def slot(tmp_path: Path) -> SlotAccount:
    """An account whose storage holds one image of two layers and no container (its
    runtime directory is one no test machine has)."""
    account = SlotAccount(uid=2**31 - 7, gid=2**31 - 7, slot_path=str(tmp_path))
    storage = Path(account.storage)
    _write(storage, removal.IMAGE_RECORDS, [{"id": "i", "layer": "top"}])
    _write(
        storage, removal.LAYER_RECORDS, [{"id": i, "parent": p} for i, p in IMAGE_LAYERS.items()]
    )
    _write(storage, removal.CONTAINER_RECORDS, [])
    return account


def test_a_storage_with_the_image_alone_is_clean(slot: SlotAccount) -> None:
    assert removal.storage_not_clean(slot, CID) is None


def test_a_layer_of_no_image_is_a_leftover(slot: SlotAccount) -> None:
    layers = [{"id": i, "parent": p} for i, p in IMAGE_LAYERS.items()]
    _write(Path(slot.storage), removal.LAYER_RECORDS, [*layers, {"id": "rw", "parent": "top"}])
    assert "layers of no image" in str(removal.storage_not_clean(slot, CID))


def test_a_volatile_container_record_is_a_leftover(slot: SlotAccount) -> None:
    _write(Path(slot.storage), removal.VOLATILE_CONTAINER_RECORDS, [{"id": CID}])
    assert "still lists a container" in str(removal.storage_not_clean(slot, CID))


def test_the_container_directory_is_a_leftover_and_a_link_there_too(slot: SlotAccount) -> None:
    directory = Path(slot.storage, "overlay-containers", CID)
    directory.mkdir()
    assert "container's directory" in str(removal.storage_not_clean(slot, CID))
    directory.rmdir()
    directory.symlink_to("/nonexistent")  # a dangling link is still something there
    assert "container's directory" in str(removal.storage_not_clean(slot, CID))


def test_a_linked_directory_on_the_way_is_never_followed(slot: SlotAccount, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    records = Path(slot.storage, "overlay-containers")
    (records / "containers.json").rename(elsewhere / "containers.json")
    records.rmdir()
    records.symlink_to(elsewhere)
    assert "could not be read" in str(removal.storage_not_clean(slot, CID))


def test_records_that_cannot_be_read_are_a_reason_never_a_crash(slot: SlotAccount) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    (Path(slot.storage) / "overlay-layers" / "layers.json").write_text(deep)
    assert "could not be read" in str(removal.storage_not_clean(slot, CID))
