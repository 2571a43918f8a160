"""The tensor-parallel ranks of one worker, as rank 0 (the engine's process) sees them.

Rank 0 is the process that runs the engine: it schedules, samples, and sends each step's
plan (engine/tp_step.py) to ranks 1..N-1, which are child processes running
engine/tp_rank.py on the same host. `TPGroup.start` creates the communicators
(engine/tp_comm.py) and spawns the ranks; `close` stops them (and a finalizer kills them
if the engine is dropped without closing).

Two channels: ``ctrl``, always shared memory, carries the steps and the control messages
(`call`), and is where an idle rank waits (calling its extension's ``idle`` between
slices, e.g. to progress its NIXL agent); ``comm`` carries the model's collectives: the
same shared memory on CPU, NCCL on GPU, or gloo. An *extension* (engine arg
``tp_rank_extension``, ``"module:factory"``) is what else a rank runs besides its shard:
the workers use it for the rank's KV transport (kvtransfer/nixl/rank_service.py). Rank 0 talks
to it with `call` (a request to every rank, each rank's reply back) and `attach` (data the
ranks get with the next step, before its forward runs, e.g. which pages to stream). A rank that exits breaks the group: rank 0's
next collective raises `TPRankLost` naming it, and the group refuses every later step; the
worker then exits and is restarted whole (Ray restarts the actor), as a rank's death
takes the worker out.

CPU threads: each rank runs ``tp_threads_per_rank`` torch threads (default: the cores this
process may use, divided by the ranks). Ranks 1..N-1 are pinned to disjoint cores when
there are enough; rank 0 is not pinned, since it also serves requests.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from typing import Any

import msgpack
import torch

from .config import ConfigError, EngineConfig
from .tp_comm import Comm, ProcessGroupComm, ShmComm, TPRankLost, new_segment_name, shm_available
from .tp_step import control_header, encode_step, gather_bytes, stop_header, to_tensor

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # the other ranks load their weights within this
STOP_TIMEOUT_S = 10.0


class TPControlError(RuntimeError):
    """A rank's extension failed a control request; the message names the rank."""


class TPGroupBroken(RuntimeError):
    """The ranks no longer run in step (one exited, or a step failed part-way): this engine
    cannot run another step; restart the worker."""


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def threads_per_rank(cfg: EngineConfig) -> int:
    if cfg.tp_threads_per_rank:
        return cfg.tp_threads_per_rank
    return max(1, len(usable_cpus()) // cfg.tensor_parallel_size)


def resolve_comm(cfg: EngineConfig, device: torch.device) -> str:
    """``tp_comm`` after ``auto``: NCCL on GPU (gloo where ranks share a device: tp_device_ids),
    shared memory on CPU."""
    want = cfg.tp_comm
    why = shm_available()
    if why is not None:
        raise ConfigError(f"tensor_parallel_size={cfg.tensor_parallel_size} needs shared memory between its ranks "
                          f"(steps and control go through it): {why}")
    if device.type == "cuda":
        ids = cfg.tp_device_ids or []
        shared = len(set(ids)) < len(ids)  # ranks sharing a device: NCCL takes one device per rank
        if want == "shm" or (want == "nccl" and shared):
            raise ConfigError(f"tp_comm={want!r} on a GPU engine{' whose ranks share a device' if shared else ''}; "
                              f"use tp_comm='{'gloo' if shared else 'nccl'}' (or 'auto')")
        return "gloo" if shared or want == "gloo" else "nccl"
    if want == "nccl":
        raise ConfigError("tp_comm='nccl' needs device='cuda'; on CPU use tp_comm='shm' or 'gloo' (or 'auto')")
    return "shm" if want == "auto" else want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # the ranks of one worker share a host: loopback only
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    """Last resort (finalizer): end the rank processes without talking to them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass


class TPGroup:
    def __init__(self, cfg: EngineConfig, ctrl: ShmComm, comm: Comm, procs: list[subprocess.Popen], threads: int,
                 restore_threads: int):
        self.cfg, self.ctrl, self.comm, self.procs = cfg, ctrl, comm, procs
        # Held for one whole exchange with the ranks (a step, from its broadcast to its last
        # collective, or a control call, from its request to the replies): they read one
        # message stream, and on shm the step's collectives share its slots, so two threads'
        # exchanges must not interleave (a worker's transport calls come from other threads
        # than its engine's steps).
        self.exchange = threading.RLock()
        self._attachments: list = []
        self.size = cfg.tensor_parallel_size
        self.threads = threads
        self.broken: str | None = None
        self.undelivered: list = []  # the attachments of a step whose sending failed
        self._restore_threads = restore_threads
        self._finalizer = weakref.finalize(self, _stop, procs)

    @classmethod
    def start(cls, cfg: EngineConfig, device: torch.device) -> "TPGroup":
        size = cfg.tensor_parallel_size
        kind = resolve_comm(cfg, device)
        threads = threads_per_rank(cfg)
        cpus = usable_cpus()
        segment = new_segment_name()
        spec: dict[str, Any] = {  # (json: the ranks' command line)
            "config": asdict(cfg), "size": size, "threads": threads, "comm": kind, "segment": segment,
            "device": str(device), "parent": os.getpid(), "extension": cfg.tp_rank_extension}
        procs: list[subprocess.Popen] = []

        def alive() -> str | None:
            for r, p in enumerate(procs, start=1):
                code = p.poll()
                if code is not None:
                    return (f"tensor-parallel rank {r} (pid {p.pid}) exited with code {code}; "
                            "its error, if any, is in this worker's log above")
            return None

        ctrl = ShmComm(segment, 0, size, alive, create=True, timeout_s=STARTUP_TIMEOUT_S)
        comm: Comm = ctrl
        if kind != "shm":
            spec["host"], spec["port"] = "127.0.0.1", _free_port()
        try:
            for rank in range(1, size):
                rank_cpus = cpus[rank * threads:(rank + 1) * threads] if len(cpus) >= size * threads else None
                env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pdserve.engine.tp_rank",
                     json.dumps({**spec, "rank": rank, "cpus": rank_cpus})], env=env))
            if kind != "shm":
                comm = ProcessGroupComm(kind, spec["host"], spec["port"], 0, size, timeout_s=STARTUP_TIMEOUT_S,
                                        device=device)
        except BaseException:
            _stop(procs)
            ctrl.unlink()
            raise
        restore = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(threads)
        log.info("tensor parallelism: %d ranks (%s collectives, %d threads each), ranks 1..%d are pids %s",
                 size, kind, threads, size - 1, [p.pid for p in procs])
        return cls(cfg, ctrl, comm, procs, threads, restore)

    def started(self) -> None:
        """Every rank has joined (its first collective returned): drop the start-up allowances."""
        self.ctrl.unlink()  # every rank has it mapped
        self.ctrl.timeout_s = self.comm.timeout_s = 120.0

    def check(self) -> None:
        if self.broken:
            raise TPGroupBroken(f"tensor-parallel group is broken: {self.broken}; restart the worker")

    def attach(self, item) -> None:
        """Give the ranks' extensions ``item`` (msgpack-able) with the next step."""
        self._attachments.append(item)

    def send_step(self, batch) -> None:
        attached, self._attachments = self._attachments, []
        try:
            self.check()
            blob = msgpack.packb(attached) if attached else b""
            header, payload = encode_step(batch, len(blob))
            self.ctrl.broadcast_(header)
            self.ctrl.broadcast_(payload)
            if blob:
                self.ctrl.broadcast_(to_tensor(blob))
        except (TPGroupBroken, TPRankLost):
            # Nothing was sent, or a rank is gone: each broadcast ends in a barrier every rank
            # must reach before any copies what was sent, and a dead rank never reaches it, so no
            # rank received these attachments (the writes they start were never posted;
            # kvtransfer/nixl/tp_transport.py settles them). Not so after a timeout: a slow rank may
            # reach the barrier later and copy them.
            self.undelivered = attached
            raise

    def call(self, op: str, **args) -> list[dict]:
        """Run ``op`` in every other rank's extension; their replies, rank 1 first.
        `TPControlError` when a rank's extension raised (the ranks stay in step)."""
        msg = msgpack.packb({"op": op, "args": args})
        with self.exchange:
            self.check()
            try:
                self.ctrl.broadcast_(control_header(len(msg)))
                self.ctrl.broadcast_(to_tensor(msg))
                gathered = gather_bytes(self.ctrl, b"")
                assert gathered is not None  # rank 0 (this process) gathers every rank's
                replies = [msgpack.unpackb(r) for r in gathered[1:]]
            except BaseException as exc:
                raise self.fail(exc) from exc
        errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(replies, start=1) if "error" in rep]
        if errors:
            raise TPControlError(f"{op}: " + "; ".join(errors))
        return replies

    def fail(self, exc: BaseException) -> TPGroupBroken:
        """A step failed part-way on rank 0: the ranks are out of step; stop them."""
        self.broken = str(exc) if isinstance(exc, TPRankLost) else f"a step failed on rank 0: {exc!r}"
        _stop(self.procs)
        return TPGroupBroken(f"tensor-parallel group is broken: {self.broken}; restart the worker")

    def close(self) -> None:
        if not self.broken and all(p.poll() is None for p in self.procs):
            try:
                with self.exchange:
                    self.ctrl.timeout_s = STOP_TIMEOUT_S
                    self.ctrl.broadcast_(stop_header())
            except (TPRankLost, RuntimeError) as exc:
                log.warning("tensor parallelism: stopping the ranks: %s", exc)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
        self._finalizer()
        self.ctrl.unlink()
        self.comm.close()
        self.ctrl.close()
        torch.set_num_threads(self._restore_threads)
        self.broken = self.broken or "closed"

