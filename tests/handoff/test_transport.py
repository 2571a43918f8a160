"""The transport contract (kvtransfer/transport.py) is what pdserve.kvtransfer implements."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from pdserve.kvtransfer import PrefillDone, PrefillFailed
from pdserve.kvtransfer.notices import MAX_TOP_LOGPROBS
from pdserve.kvtransfer.transport import (
    MAX_NOTIFICATION_BYTES,
    KVReceiver,
    KVSender,
    LayerWrites,
    TransportError,
    WriteFailed,
    WriteTimedOut,
)
from pdserve.kvtransfer.nixl import KVTransferAgent, LayerStream, TransferHandle
from pdserve.kvtransfer.nixl.tp_handles import TPStream
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.kvtransfer.nixl.errors import KVTransferError, TransferError, TransferTimeoutError, UnknownPeerError


def _members(protocol) -> dict[str, object]:
    skip = set(dir(object)) | {"_is_protocol", "_is_runtime_protocol", "__protocol_attrs__",
                               "__non_callable_proto_members__", "__annotations__", "__abstractmethods__"}
    return {n: getattr(protocol, n) for n in dir(protocol) if n not in skip and not n.startswith("_")}


def _set_in_init(impl) -> set[str]:
    """The attributes `impl.__init__` assigns (`self.<name> = ...`): a read-only property of the
    contract is met by a plain attribute of every instance."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(impl.__init__)))
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return {n.attr for t in targets for n in ast.walk(t)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("protocol, impl", [(KVSender, KVTransferAgent), (KVReceiver, KVTransferAgent),
                                            (LayerWrites, LayerStream),
                                            # a worker's, over its tensor-parallel ranks (kvtransfer/nixl/)
                                            (KVSender, TPSender), (KVReceiver, TPReceiver), (LayerWrites, TPStream)])
def test_the_agent_has_every_member_with_the_contracts_parameters(protocol, impl):
    for name, member in _members(protocol).items():
        if isinstance(member, property) and not hasattr(impl, name):
            assert name in _set_in_init(impl), f"{impl.__name__} lacks {name}"
            continue
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        if inspect.isfunction(member):
            theirs = inspect.signature(getattr(impl, name)).parameters
            for pname, p in inspect.signature(member).parameters.items():
                assert pname in theirs, f"{impl.__name__}.{name} has no parameter {pname!r}"
                if p.default is not inspect.Parameter.empty:
                    assert theirs[pname].default == p.default, f"{impl.__name__}.{name}({pname}=...)"


def test_a_transfer_handle_is_a_write_handle():
    h = TransferHandle(1, "d0", num_bytes=64, num_descriptors=1, layers=(0,), notify=None)
    assert h.num_bytes == 64 and h.finished is False


def test_the_agents_errors_are_the_contracts():
    assert issubclass(KVTransferError, TransportError)
    assert issubclass(TransferError, WriteFailed) and issubclass(UnknownPeerError, WriteFailed)
    assert issubclass(TransferTimeoutError, WriteTimedOut)


def test_the_largest_notices_fit_one_notification():
    rid = "x" * 256  # longer than any request id the API accepts
    done = PrefillDone(rid, 2**31, 2**31, -1.5, 2**31, queue_wait_ms=1e9, prefill_ms=1e9, sent_at=2e9,
                       prefill_worker="p" * 64, batch_tokens=2**31,
                       first_top_logprobs=tuple((2**31 - i, -1.5) for i in range(MAX_TOP_LOGPROBS)))
    assert len(done.encode()) <= MAX_NOTIFICATION_BYTES
    # Wrapped for a (prefill rank, decode rank) pair of a TP handoff (kvtransfer/ranked.py): still fits.
    from pdserve.kvtransfer.ranked import wrap

    assert len(wrap(done.encode(), 254, 255, 254, 255)) <= MAX_NOTIFICATION_BYTES
    failed = PrefillFailed(rid, 2**31, "transfer_error", "d" * 1000, "p" * 64, False)
    assert len(failed.encode()) <= MAX_NOTIFICATION_BYTES
