"""pdserve.kvtransfer.nixl: NIXL page writes from a prefill worker's KV pool into a decode worker's.

One `KVTransferAgent` per worker process registers the whole KV pool once;
peers exchange `local_info()` records (via etcd), check layouts at
`add_peer`, and then `write_blocks` / `begin_stream` move K and V pages,
ending with a notification (the handoff's notices, pdserve.kvtransfer.notices).
`KVTransferAgent` implements the handoff's transport contract
(kvtransfer/transport.py). See docs/kvtransfer.md.
"""

from pdserve.kvtransfer.nixl.agent import KVTransferAgent
from pdserve.kvtransfer.nixl.descriptors import WritePlan, block_runs, plan_block_write
from pdserve.kvtransfer.nixl.errors import (
    KVTransferError,
    LayoutMismatchError,
    MalformedMessageError,
    NixlUnavailableError,
    TransferError,
    TransferTimeoutError,
    UnknownPeerError,
)
from pdserve.kvtransfer.nixl.layout import KVLayout
from pdserve.kvtransfer.nixl.nixl_shim import LOOPBACK_UCX_ENV, NixlApi, load_nixl
from pdserve.kvtransfer.nixl.peer import PeerInfo
from pdserve.kvtransfer.nixl.stream import LayerStream
from pdserve.kvtransfer.nixl.transfer import Notification, PollResult, TransferHandle, TransferState

__all__ = [
    "KVLayout",
    "KVTransferAgent",
    "KVTransferError",
    "LOOPBACK_UCX_ENV",
    "LayerStream",
    "LayoutMismatchError",
    "MalformedMessageError",
    "NixlApi",
    "NixlUnavailableError",
    "Notification",
    "PeerInfo",
    "PollResult",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeoutError",
    "UnknownPeerError",
    "WritePlan",
    "block_runs",
    "load_nixl",
    "plan_block_write",
]
