"""Test plumbing: a child process that owns one KVTransferAgent and obeys the test.

The test talks to each child over a multiprocessing pipe with plain dicts
(and raw bytes for pool snapshots). What travels between agents is only
NIXL's own traffic plus the JSON peer records and notification bytes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import signal
import time
from typing import Any

import numpy as np

from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout

# Generous: the first answer includes spawn + importing torch and NIXL on a loaded 2-core box.
REPLY_TIMEOUT_S = 120.0
IDLE_POLL_INTERVAL_S = 0.001


def pool_bytes_from_seed(layout: KVLayout, seed: int) -> np.ndarray:
    """Deterministic pool content as uint8 `[num_layers, num_blocks, block_bytes]`."""
    raw = np.random.default_rng(seed).bytes(layout.pool_bytes)
    shape = (layout.num_layers, layout.num_blocks, layout.block_bytes)
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape).copy()


def encoded_pool(layout: KVLayout, heads: list[int]) -> np.ndarray:
    """An HND float32 pool [L, N, 2, H, block_size, D] whose value at (layer, block, K/V, local
    head h, token, dim) encodes (global head heads[h], layer, block, K/V, token, dim) exactly."""
    assert layout.kv_layout == "HND" and layout.dtype == "float32"
    L, N, _, H, B, D = layout.shape
    layer, block, kv, head, tok, dim = np.meshgrid(range(L), range(N), range(2), np.asarray(heads), range(B),
                                                   range(D), indexing="ij")
    return (((((head * L + layer) * N + block) * 2 + kv) * B + tok) * D + dim).astype(np.float32)


def blocks_digest(pool: np.ndarray, block_ids: list[int]) -> str:
    """Hash of the given blocks across all layers of a `[L, N, block_bytes]` pool view."""
    return hashlib.blake2b(np.ascontiguousarray(pool[:, block_ids]).tobytes()).hexdigest()


# ---- child side -----------------------------------------------------------


def peer_main(conn: Any, netns: str | None = None, ucx_env: dict | None = None) -> None:
    """Entry point of the child: serve commands until "exit". With ``netns``, the child first
    moves into that network namespace (a test host, tests/multihost/netns.py)."""
    if netns is not None:
        from pdserve.bench.netns import enter_netns

        enter_netns(netns)  # before any thread or socket exists
    ucx_env = dict(ucx_env or LOOPBACK_UCX_ENV)
    os.environ.update(ucx_env)  # before this process creates any agent
    peer = _Peer(conn, ucx_env)
    try:
        while True:
            # Like a worker's step loop: keep NIXL progressing between commands
            # (the progress thread is off, so an idle target would stall wireup).
            while not conn.poll(IDLE_POLL_INTERVAL_S):
                peer.idle()
            command = conn.recv()
            op = command.pop("op")
            if op == "exit":
                break
            try:
                reply = getattr(peer, op)(**command) or {}
                conn.send({"ok": True, **reply})
            except Exception as exc:  # reported to the test, which asserts on it
                conn.send(
                    {
                        "ok": False,
                        "error": type(exc).__name__,
                        "message": str(exc),
                        "field": getattr(exc, "field", None),
                    }
                )
    finally:
        peer.close()
    conn.send({"ok": True, "closed": True})


class _Peer:
    def __init__(self, conn: Any, ucx_env: dict):
        self.conn = conn
        self.ucx_env = ucx_env
        self.agent = None
        self.kv = None
        self.pools: dict[str, Any] = {}  # name -> (tensor, layout): pools beyond the model's
        self.unclaimed: list[dict] = []  # notifications that arrived while idle

    def idle(self) -> None:
        if self.agent is not None:
            self.unclaimed += self._notes(self.agent.poll())

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.kv = None

    def open(self, name: str, layout: dict, seed: int, device: str = "cpu", pools: dict | None = None) -> dict:
        """An agent over a pool of ``layout`` filled from ``seed``; ``pools``: name -> (layout
        dict, seed) of more pools registered beside it (kvtransfer/nixl/pools.py)."""
        import torch

        from pdserve.kvtransfer.nixl import KVTransferAgent

        self.close()
        self.unclaimed = []
        self.layout = KVLayout.from_dict(layout)
        self.kv = torch.empty(self.layout.shape, dtype=getattr(torch, self.layout.dtype), device=device)
        self.fill(seed)
        self.pools = {}
        for pname, (playout, pseed) in (pools or {}).items():
            lay = KVLayout.from_dict(playout)
            t = torch.from_numpy(pool_bytes_from_seed(lay, pseed).copy()).view(getattr(torch, lay.dtype))
            self.pools[pname] = (t.reshape(lay.shape), lay)
        self.agent = KVTransferAgent(name, self.kv, self.layout, ucx_env=self.ucx_env, pools=self.pools)
        return {"info": self.agent.local_info()}

    def has_pool(self, peer: str, pool: str) -> dict:
        return {"has": self.agent.has_pool(peer, pool)}

    def open_encoded(self, name: str, layout: dict, heads: list[int] | None, threads: int = 0,
                     split_batch_size: int = 0) -> dict:
        """A float32 pool whose every value encodes where it sits (`encoded_pool`): the given
        global ``heads`` (a TP rank's), or all -1 when ``heads`` is None (a fresh target); its
        agent posts large writes from ``threads`` NIXL threads."""
        import torch

        from pdserve.kvtransfer.nixl import KVTransferAgent

        self.close()
        self.unclaimed = []
        self.layout = KVLayout.from_dict(layout)
        values = np.full(self.layout.shape, -1.0, dtype=np.float32) if heads is None else \
            encoded_pool(self.layout, heads)
        self.kv = torch.from_numpy(values)
        self.agent = KVTransferAgent(name, self.kv, self.layout, ucx_env=self.ucx_env, num_threads=threads,
                                     split_batch_size=split_batch_size)
        return {"info": self.agent.local_info()}

    def write_heads(self, peer, local, remote, src_head, dst_head, num_heads, notify=None, timeout_s=10.0) -> dict:
        handle = self.agent.write_blocks(peer, local, remote, notify=notify, heads=(src_head, dst_head, num_heads))
        self.agent.wait(handle, timeout_s)
        self._drain()
        return {"num_bytes": handle.num_bytes, "num_descriptors": handle.num_descriptors,
                "elapsed_s": handle.elapsed_s}

    def fill(self, seed: int) -> None:
        import torch

        data = torch.from_numpy(pool_bytes_from_seed(self.layout, seed))
        self.kv.view(-1).view(torch.uint8).copy_(data.view(-1))

    def add_peer(self, info: dict) -> dict:
        return {"name": self.agent.add_peer(info)}

    def remove_peer(self, name: str) -> dict:
        return {"removed": self.agent.remove_peer(name)}

    def write(self, peer, local, remote, layers=None, notify=None, timeout_s=10.0, coalesce=True, pool=None) -> dict:
        handle = self.agent.write_blocks(peer, local, remote, layers, notify, coalesce=coalesce, pool=pool)
        self.agent.wait(handle, timeout_s)
        self._drain()
        return {
            "num_bytes": handle.num_bytes,
            "num_descriptors": handle.num_descriptors,
            "elapsed_s": handle.elapsed_s,
        }

    def read(self, peer, local, remote, notify=None, timeout_s=10.0) -> dict:
        handle = self.agent.read_blocks(peer, local, remote, notify)
        self.agent.wait(handle, timeout_s)
        self._drain()
        return {"num_bytes": handle.num_bytes, "num_descriptors": handle.num_descriptors}

    def stream(self, peer, local, remote, notify, timeout_s=10.0, skip_layers=()) -> dict:
        stream = self.agent.begin_stream(peer, local, remote, notify)
        for layer in stream.layers:
            if layer not in skip_layers:
                stream.write_layer(layer)
        handles = stream.finish(timeout_s)
        self._drain()
        return {"layers_done": [h.layers[0] for h in handles if h.done]}

    def write_until_error(self, peer, local, remote, timeout_s, max_s) -> dict:
        """Write again and again (reporting after the first success) until a write fails."""
        writes_ok = 0
        start = time.monotonic()
        while time.monotonic() - start < max_s:
            try:
                self.agent.wait(self.agent.write_blocks(peer, local, remote), timeout_s)
            except Exception as exc:
                return {"writes_ok": writes_ok, "error": type(exc).__name__, "message": str(exc)}
            writes_ok += 1
            if writes_ok == 1:
                self.conn.send({"event": "writing"})
        return {"writes_ok": writes_ok, "error": None, "message": "no failure"}

    def collect(self, count: int, timeout_s: float, digest_blocks: list[int] | None = None) -> dict:
        """Poll until `count` notifications arrived; hash `digest_blocks` as the first one lands."""
        notes, self.unclaimed = self.unclaimed, []
        digest = None
        deadline = time.monotonic() + timeout_s
        while len(notes) < count and time.monotonic() < deadline:
            arrived = self._notes(self.agent.poll())
            if arrived and not notes and digest_blocks is not None:
                digest = blocks_digest(self._pool_view(), digest_blocks)
            notes += arrived
        if notes and digest is None and digest_blocks is not None:  # it arrived while idle
            digest = blocks_digest(self._pool_view(), digest_blocks)
        return {"notifications": notes, "digest_at_first": digest}

    @staticmethod
    def _notes(result: Any) -> list[dict]:
        return [{"sender": n.sender, "payload": n.payload} for n in result.notifications]

    def snapshot(self, pool: str | None = None) -> dict:
        if pool is None:
            return {"data": self._pool_view().tobytes()}
        return {"data": self.pools[pool][0].reshape(-1).view(__import__("torch").uint8).numpy().tobytes()}

    def _pool_view(self) -> np.ndarray:
        import torch

        flat = self.kv.reshape(-1).view(torch.uint8).cpu().numpy()
        return flat.reshape(self.layout.num_layers, self.layout.num_blocks, self.layout.block_bytes)

    def _drain(self) -> None:
        self.idle()  # forget finished handles so the agent's lists stay small


# ---- test side ------------------------------------------------------------

class PeerProcess:
    """Handle on one child process (spawn context) running `peer_main`."""

    def __init__(self, ctx: Any, label: str, netns: str | None = None, ucx_env: dict | None = None):
        self.label = label
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child_conn, netns, ucx_env), name=label, daemon=True)
        self.proc.start()
        child_conn.close()
        self.stopped = False

    def send(self, op: str, **kwargs: Any) -> None:
        self.conn.send({"op": op, **kwargs})

    def receive(self, reply_timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        if not self.conn.poll(reply_timeout_s):
            raise TimeoutError(f"peer {self.label} gave no answer within {reply_timeout_s} s")
        return self.conn.recv()

    def call(self, op: str, reply_timeout_s: float = REPLY_TIMEOUT_S, **kwargs: Any) -> dict:
        """Run a command; return its reply dict (ok may be False, with error details)."""
        self.send(op, **kwargs)
        return self.receive(reply_timeout_s)

    def ok(self, op: str, reply_timeout_s: float = REPLY_TIMEOUT_S, **kwargs: Any) -> dict:
        reply = self.call(op, reply_timeout_s, **kwargs)
        assert reply["ok"], f"{self.label}.{op} failed: {reply['error']}: {reply['message']}"
        return reply

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(REPLY_TIMEOUT_S)
        self.stopped = True

    def stop(self, timeout_s: float = REPLY_TIMEOUT_S) -> int | None:
        """Ask the child to close its agent and exit; return its exit code."""
        if not self.stopped:
            self.stopped = True
            if self.proc.is_alive():
                self.send("exit")
                self.receive(timeout_s)
            self.proc.join(timeout_s)
            if self.proc.is_alive():  # hung at exit: that is a failure the exit code shows
                self.proc.kill()
                self.proc.join(timeout_s)
        return self.proc.exitcode


# ---- test-side helpers: open agents, predict and compare pool bytes ----------

_agent_names = itertools.count()


def llama8b(dtype: str, num_blocks: int) -> KVLayout:
    """Llama-3-8B KV geometry: 2 MiB per block across 32 layers."""
    return KVLayout("llama-3-8b", dtype, num_layers=32, num_blocks=num_blocks, block_size=16,
                    num_kv_heads=8, head_dim=128)


def open_agent(proc: PeerProcess, layout: KVLayout, seed: int, device: str = "cpu") -> dict:
    """Give `proc` an agent over a pool of `layout` filled from `seed`; reuse it if the layout matches."""
    if getattr(proc, "layout", None) == layout:
        proc.ok("fill", seed=seed)
        return proc.info
    name = f"{proc.label}-{next(_agent_names)}"
    proc.info = proc.ok("open", name=name, layout=layout.to_dict(), seed=seed, device=device)["info"]
    proc.layout = layout
    return proc.info


def connect(sender: PeerProcess, receiver: PeerProcess) -> str:
    return sender.ok("add_peer", info=receiver.info)["name"]


@functools.lru_cache(maxsize=8)
def seeded_pool(layout: KVLayout, seed: int) -> np.ndarray:
    """Cached `pool_bytes_from_seed` for the test side (treat as read-only)."""
    return pool_bytes_from_seed(layout, seed)


def expected_pool(recv: tuple[KVLayout, int], writes: list[tuple], layers=None) -> np.ndarray:
    """Receiver pool after `writes` = [(sender layout, seed, local ids, remote ids)]."""
    pool = seeded_pool(*recv).copy()
    layer_ids = list(range(pool.shape[0])) if layers is None else list(layers)
    for send_layout, send_seed, local, remote in writes:
        src = seeded_pool(send_layout, send_seed)
        pool[np.ix_(layer_ids, remote)] = src[np.ix_(layer_ids, local)]
    return pool


def snapshot(proc: PeerProcess) -> np.ndarray:
    data = proc.ok("snapshot")["data"]
    layout = proc.layout
    return np.frombuffer(data, dtype=np.uint8).reshape(layout.num_layers, layout.num_blocks, -1)


def assert_pool_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    differ = np.argwhere((actual != expected).any(axis=2))
    assert differ.size == 0, f"{len(differ)} (layer, block) pages differ, e.g. {differ[:8].tolist()}"


def mapping(kind: str, n: int, num_src: int, num_dst: int, seed: int) -> tuple[list[int], list[int]]:
    """A block-id mapping of `n` blocks: scattered, reversed, or runs consecutive on both sides."""
    rng = np.random.default_rng(seed)
    if kind == "scattered":
        return (rng.choice(num_src, n, replace=False).tolist(),
                rng.choice(num_dst, n, replace=False).tolist())
    if kind == "reversed":
        return list(range(n)), list(range(num_dst - 1, num_dst - 1 - n, -1))
    assert kind == "runs"
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(min(rng.integers(1, 7), n - sum(lengths))))
    local, cursor = [], 0
    for length in lengths:  # in order, gaps of 0 or 1 (a 0 gap must still split if remote jumps)
        cursor += int(rng.integers(0, 2))
        local += list(range(cursor, cursor + length))
        cursor += length
    remote_starts, cursor = {}, 0
    for i in rng.permutation(len(lengths)):  # runs land in shuffled order on the remote side
        cursor += int(rng.integers(0, 3))
        remote_starts[i] = cursor
        cursor += lengths[i]
    remote = [remote_starts[i] + k for i, length in enumerate(lengths) for k in range(length)]
    assert max(local) < num_src and max(remote) < num_dst
    return local, remote
