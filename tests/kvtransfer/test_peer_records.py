"""Records that cross processes in the data plane: a peer's NIXL record, and the NIXL shim."""

from __future__ import annotations

import base64
import json

import pytest

from pdserve.kvtransfer.nixl import KVLayout, MalformedMessageError, PeerInfo, load_nixl

LAYOUT = KVLayout("tiny", "float16", 3, 10, 4, 2, 8)
INFO = PeerInfo("d0", b"\x00nixl-md\xff", LAYOUT, pool_addr=0x7F00_0000_0000,
                pool_bytes=LAYOUT.pool_bytes, mem_type="DRAM", device_id=0)


def test_peer_record_is_json_and_round_trips():
    record = json.loads(json.dumps(INFO.to_dict()))
    assert base64.b64decode(record["nixl_metadata"]) == b"\x00nixl-md\xff"
    assert PeerInfo.from_dict(record) == INFO


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other/9"}, "format"),
        ({"nixl_metadata": "not base64!"}, "bad peer record"),
        ({"name": ""}, "name"),
        ({"pool": {**INFO.to_dict()["pool"], "mem_type": "HBM"}}, "mem_type"),
        ({"pool": {**INFO.to_dict()["pool"], "num_bytes": 1}}, "layout needs"),
        ({"layout": {"model_id": "tiny"}}, "lacks"),
    ],
)
def test_malformed_peer_records_are_refused(change, message):
    with pytest.raises(MalformedMessageError, match=message):
        PeerInfo.from_dict({**INFO.to_dict(), **change})


def test_the_shim_prefers_the_cu12_build():
    assert load_nixl().module_name == "nixl_cu12._api"

