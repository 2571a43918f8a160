"""pdserve.kvtransfer: NIXL page writes from a prefill worker's KV pool into a decode worker's.

One `KVTransferAgent` per worker process registers the whole KV pool once;
peers exchange `local_info()` records (via etcd), check layouts at
`add_peer`, and then `write_blocks` / `begin_stream` move K and V pages,
ending with a `PrefillDone` notification (or a `PrefillFailed` one when the
attempt cannot be delivered). See docs/kvtransfer.md.
"""

from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.descriptors import WritePlan, block_runs, plan_block_write
from pdserve.kvtransfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    MalformedMessageError,
    NixlUnavailableError,
    TransferError,
    TransferTimeoutError,
    UnknownPeerError,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.messages import (
    MAX_NOTIFICATION_BYTES,
    PREFILL_DONE_VERSION,
    PREFILL_FAILED_VERSION,
    PrefillDone,
    PrefillFailed,
    decode_notification,
    decode_prefill_done,
    decode_prefill_failed,
    encode_prefill_done,
)
from pdserve.kvtransfer.nixl_shim import LOOPBACK_UCX_ENV, NixlApi, load_nixl
from pdserve.kvtransfer.peer import PeerInfo
from pdserve.kvtransfer.stream import LayerStream
from pdserve.kvtransfer.transfer import Notification, PollResult, TransferHandle, TransferState

__all__ = [
    "KVLayout",
    "KVTransferAgent",
    "KVTransferError",
    "LOOPBACK_UCX_ENV",
    "LayerStream",
    "LayoutMismatchError",
    "MAX_NOTIFICATION_BYTES",
    "MalformedMessageError",
    "NixlApi",
    "NixlUnavailableError",
    "Notification",
    "PREFILL_DONE_VERSION",
    "PeerInfo",
    "PollResult",
    "PREFILL_FAILED_VERSION",
    "PrefillDone",
    "PrefillFailed",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeoutError",
    "UnknownPeerError",
    "WritePlan",
    "block_runs",
    "decode_notification",
    "decode_prefill_done",
    "decode_prefill_failed",
    "encode_prefill_done",
    "load_nixl",
    "plan_block_write",
]
