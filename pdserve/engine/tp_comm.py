"""Collectives between the tensor-parallel ranks of one worker (one host).

Three operations are all a TP step needs: ``all_reduce_`` (the row-parallel layers and the
vocab-parallel embedding), ``gather`` to rank 0 (the vocab-parallel LM head's logits) and
``broadcast_`` from rank 0 (each step's plan, engine/tp_step.py).

- `ShmComm` (``tp_comm='shm'``, the CPU default): one shared-memory segment holding a slot
  per rank, two sets of them used alternately, and a counter. A collective copies this
  rank's data into its slot, arrives at the counter, waits for the others
  (csrc/shm_sync.c: spin, then futex) and reads their slots. Every rank sums the slots in
  rank order, so all ranks hold bit-identical results (the ranks' hidden states must not
  drift apart). Measured against gloo in bench/tp.py: gloo's loopback all-reduce costs
  ~0.8-1.9 ms a call on this machine, which twelve times a decode step cannot afford.
- `ProcessGroupComm` (``tp_comm='gloo'`` on CPU; NCCL on GPU): torch's process groups over a
  TCP store on this host, created directly (not ``init_process_group``), so several
  engines in one process each have their own.

Every wait is bounded: a wait sleeps in slices and between slices asks ``alive()`` whether
the peers still run (rank 0: its rank processes; the others: rank 0), raising
`TPRankLost` when one is gone, and `TPTimeout` after ``timeout_s``.
"""

from __future__ import annotations

import abc
import ctypes
import datetime
import mmap
import os
import secrets
import time
from typing import Callable

import torch

from . import native

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096  # the counter, alone on its page
DEFAULT_SLOT_BYTES = 4 << 20
WAIT_SLICE_US = 100_000  # between liveness checks
IDLE_SLICE_US = 2_000  # between calls of an idle hook (a NIXL agent's progress)
SPINS_PER_WAIT = 20_000  # ~20-50 us of spinning before sleeping, when every rank has a core


class TPRankLost(RuntimeError):
    """A tensor-parallel rank of this worker exited: the worker cannot run another step."""


class TPTimeout(RuntimeError):
    """A collective waited longer than its timeout for the other ranks."""


def _declare_sync(lib) -> None:
    u32p, u32, i64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64
    lib.pdserve_shm_arrive.argtypes = [u32p, u32]
    lib.pdserve_shm_arrive.restype = None
    lib.pdserve_shm_wait.argtypes = [u32p, u32, i64, i64]
    lib.pdserve_shm_wait.restype = ctypes.c_int


def load_sync():
    return native.load_library("shm_sync.c", _declare_sync)


def shm_available() -> str | None:
    """None when the shared-memory communicator can run here, else why not."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    if load_sync() is None:
        return native.why_unavailable("shm_sync.c")
    return None


class Comm(abc.ABC):
    """What the model and the step loop call; ``rank``/``size`` of this group. Implemented by
    `ShmComm` and `ProcessGroupComm`."""

    rank: int
    size: int
    # A call's default deadline: ShmComm's (its __init__ sets it); tp_group.py and tp_rank.py
    # set it on either kind once every rank has joined (ProcessGroupComm does not read it).
    timeout_s: float
    name = "base"

    @abc.abstractmethod
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (the same bits on every rank)."""

    @abc.abstractmethod
    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape on all) at rank 0, in rank order; None elsewhere."""

    @abc.abstractmethod
    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into ``t`` on every rank (same shape and dtype on all)."""

    def close(self) -> None:
        pass


def new_segment_name() -> str:
    return f"pdserve-tp-{os.getpid()}-{secrets.token_hex(4)}"


def segment_bytes(size: int, slot_bytes: int) -> int:
    return HEADER_BYTES + 2 * size * slot_bytes


class ShmComm(Comm):
    """Shared-memory collectives; rank 0 creates the segment (``create=True``), the others open it.

    Rank 0 unlinks the file once every rank has mapped it (`unlink`), so a crash leaves nothing
    in /dev/shm after start-up.
    """

    name = "shm"

    def __init__(self, segment: str, rank: int, size: int, alive: Callable[[], str | None],
                 create: bool = False, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 120.0):
        lib = load_sync()
        if lib is None:
            raise RuntimeError(f"tp_comm='shm' is unavailable: {native.why_unavailable('shm_sync.c')}; "
                               "use tp_comm='gloo'")
        self._lib, self.rank, self.size, self.slot_bytes = lib, rank, size, slot_bytes
        self.alive, self.timeout_s = alive, timeout_s
        self.path = os.path.join(SHM_DIR, segment)
        total = segment_bytes(size, slot_bytes)
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._counter = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._calls = 0
        # Spinning only pays when every rank has a core of its own.
        self._spins = SPINS_PER_WAIT if size <= (os.cpu_count() or 1) else 0

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = HEADER_BYTES + (parity * self.size + rank) * self.slot_bytes
        return self._buf[start:start + nbytes]

    def _barrier(self, timeout_s: float | None = None, idle: Callable[[], None] | None = None) -> int:
        """Arrive and wait for every rank; returns the parity of the slots this collective uses.
        ``idle`` runs between short slices of the wait (a rank's transport progress)."""
        self._calls += 1
        target = (self._calls * self.size) & 0xFFFFFFFF
        self._lib.pdserve_shm_arrive(self._counter, target)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spins = self._spins
        slice_us = WAIT_SLICE_US if idle is None else IDLE_SLICE_US
        while self._lib.pdserve_shm_wait(self._counter, target, spins, slice_us):
            spins = 0
            if idle is not None:
                idle()
            why = self.alive()
            if why:
                raise TPRankLost(why)
            if deadline is not None and time.monotonic() > deadline:
                raise TPTimeout(f"tensor-parallel rank {self.rank}: the other ranks did not reach a collective "
                                f"within {timeout_s:g} s")
        return self._calls % 2

    def _chunks(self, t: torch.Tensor):
        flat = t.view(-1).view(torch.uint8)
        step = self.slot_bytes - self.slot_bytes % t.element_size()
        for start in range(0, flat.numel(), step):
            yield flat[start:start + step]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            raise ValueError("all_reduce_ needs a contiguous tensor")
        for chunk in self._chunks(t):
            n = chunk.numel()
            parity_next = (self._calls + 1) % 2
            self._slot(parity_next, self.rank, n).copy_(chunk)
            parity = self._barrier(self.timeout_s)
            out = chunk.view(t.dtype)
            out.copy_(self._slot(parity, 0, n).view(t.dtype))
            for r in range(1, self.size):
                out.add_(self._slot(parity, r, n).view(t.dtype))
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        t = t.contiguous()
        if t.numel() == 0:  # the same on every rank (a step that samples nothing): no collective
            return [t.clone() for _ in range(self.size)] if self.rank == 0 else None
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        for chunk in self._chunks(t):
            n = chunk.numel()
            self._slot((self._calls + 1) % 2, self.rank, n).copy_(chunk)
            parity = self._barrier(self.timeout_s)
            if self.rank == 0:
                for r in range(self.size):
                    parts[r].append(self._slot(parity, r, n).clone())
        if self.rank != 0:
            return None
        return [torch.cat(p).view(t.dtype).view(t.shape) for p in parts]

    def broadcast_(self, t: torch.Tensor, timeout_s: float | None = -1.0,
                   idle: Callable[[], None] | None = None) -> torch.Tensor:
        """``timeout_s=None``: wait without a deadline (an idle rank waiting for the next step;
        rank 0's liveness is still checked every slice, and ``idle`` called)."""
        timeout = self.timeout_s if timeout_s == -1.0 else timeout_s
        for chunk in self._chunks(t):
            n = chunk.numel()
            if self.rank == 0:
                self._slot((self._calls + 1) % 2, 0, n).copy_(chunk)
            parity = self._barrier(timeout, idle)
            if self.rank != 0:
                chunk.copy_(self._slot(parity, 0, n))
        return t

    def close(self) -> None:
        self._buf = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view still exists; the mapping goes with the process


class ProcessGroupComm(Comm):
    """torch's gloo (CPU) or NCCL (GPU) process group over a TCP store on this host."""

    def __init__(self, backend: str, host: str, port: int, rank: int, size: int, timeout_s: float = 120.0,
                 device: torch.device | None = None):
        from torch.distributed import PrefixStore, TCPStore

        self.rank, self.size, self.name = rank, size, backend
        self.device = device
        # The group's timeout also bounds an idle rank's wait for the next step, so it is long;
        # a rank that exits closes its connections, which fails the others' collectives at once.
        timeout = datetime.timedelta(seconds=max(timeout_s, 86400.0))
        self._store = TCPStore(host, port, size, rank == 0, timeout=timeout)
        store = PrefixStore("pdserve-tp", self._store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self._pg = ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = ProcessGroupNCCL(store, rank, size, opts)
        else:
            raise ValueError(f"tp_comm backend {backend!r}; use gloo or nccl")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """What gloo reads and writes: the tensor itself on the CPU, a host copy of a CUDA one
        (ranks sharing a device: engine arg tp_device_ids; gloo has no all_gather of CUDA
        tensors, so every collective goes through the host there)."""
        return t.cpu() if self.name == "gloo" and t.is_cuda else t

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        h = self._host(t)
        self._pg.allreduce([h]).wait()
        if h is not t:
            t.copy_(h)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        h = self._host(t.contiguous())
        outs = [torch.empty_like(h) for _ in range(self.size)]
        self._pg.allgather([outs], [h]).wait()
        if self.rank != 0:
            return None
        return [o.to(t.device) for o in outs] if h.device != t.device else outs

    def broadcast_(self, t: torch.Tensor, timeout_s: float | None = -1.0, idle=None) -> torch.Tensor:
        h = self._host(t)
        self._pg.broadcast(h, 0).wait()
        if h is not t:
            t.copy_(h)
        return t

    def close(self) -> None:
        self._pg = None
