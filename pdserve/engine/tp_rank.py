"""A tensor-parallel rank other than 0: load this rank's shard, then run what rank 0 sends.

Started by engine/tp_group.py as ``python -m pdserve.engine.tp_rank SPEC`` (SPEC: JSON with
the engine config, this rank, the group's size and how to reach its communicators). It
schedules nothing and samples nothing: each step it receives the batch
(engine/tp_step.py), plans attention over its own heads, runs its shard (joining the
all-reduces) and sends its logits slice to rank 0.

The extension (engine arg ``tp_rank_extension``, ``"module:factory"``) is called as
``factory(runner, rank, size)`` and returns an object with:

- ``handle(op, args) -> dict``: a control request from rank 0 (`TPGroup.call`); what it
  raises goes back to rank 0 as ``{"error": ...}``;
- ``on_step(attachments) -> layer_hook | None``: before each step's forward, with what rank
  0 attached to it (`TPGroup.attach`); the hook is called as ``hook(layer, ready)``;
- ``after_step()``: after the forward;
- ``idle()``: every ~2 ms while the rank waits for rank 0 (transport progress);
- ``close()``.

The rank exits when rank 0 says stop, when rank 0's process is gone (checked between
waits), or on any error in a step (which breaks the group: rank 0 sees the exit and fails
the worker).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys

import msgpack
import torch


def load_extension(name: str, runner, rank: int, size: int):
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"tp_rank_extension={name!r}: use 'module:factory'")
    return getattr(importlib.import_module(module), attr)(runner, rank, size)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    rank, size, parent = spec["rank"], spec["size"], spec["parent"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(name)s: %(message)s")
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    torch.set_num_threads(spec["threads"])

    from .config import EngineConfig, ModelConfig
    from .kv_tier_store import TierMirror
    from .runner import ModelRunner
    from .tp_comm import ProcessGroupComm, ShmComm
    from .tp_group import STARTUP_TIMEOUT_S
    from .tp_step import ATTACH, HEADER_LEN, OP_CONTROL, OP_STOP, decode_step, gather_bytes, payload_len

    def alive() -> str | None:
        if os.getppid() != parent:
            return f"rank 0 (pid {parent}) is gone"
        return None

    cfg = EngineConfig(**spec["config"])
    ctrl = ShmComm(spec["segment"], rank, size, alive, timeout_s=STARTUP_TIMEOUT_S)
    comm: ShmComm | ProcessGroupComm = ctrl
    if spec["comm"] != "shm":
        comm = ProcessGroupComm(spec["comm"], spec["host"], spec["port"], rank, size, timeout_s=STARTUP_TIMEOUT_S,
                                device=torch.device(spec["device"]) if spec["comm"] == "nccl" else None)
    runner = ModelRunner(cfg, ModelConfig.from_dir(cfg.model), rank=rank, comm=comm, ctrl=ctrl)
    ctrl.timeout_s = comm.timeout_s = 120.0
    ext = load_extension(spec["extension"], runner, rank, size) if spec.get("extension") else None
    # The second KV tier's copies, as rank 0's tier made them (engine/kv_tier.py): this rank's heads.
    tier = TierMirror(runner.kv_cache, cfg.kv_offload_backend, cfg.kv_offload_path) if cfg.kv_offload_bytes else None
    idle = ext.idle if ext is not None else None
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    try:
        while True:
            ctrl.broadcast_(header, timeout_s=None, idle=idle)  # until rank 0 sends something
            op = int(header[0])
            if op == OP_STOP:
                return 0
            if op == OP_CONTROL:
                msg = msgpack.unpackb(bytes(ctrl.broadcast_(torch.empty(int(header[1]), dtype=torch.uint8)).numpy()))
                reply: dict
                try:
                    if msg["op"] == "tier" and tier is not None:
                        tier.apply(msg["args"]["slots"], msg["args"]["ops"], sync=True)  # ids leave the engine
                        reply = {}
                    elif msg["op"] == "lora" and runner.lora is not None:  # fill an adapter slot (engine/lora_slots.py)
                        reply = runner.lora.handle(msg["args"])
                    elif ext is None:
                        raise RuntimeError("this rank runs no extension (engine arg tp_rank_extension)")
                    else:
                        reply = ext.handle(msg["op"], msg["args"]) or {}
                except Exception as exc:  # noqa: BLE001  (reported to rank 0, which raises it there)
                    logging.getLogger(__name__).exception("control request %s failed", msg.get("op"))
                    reply = {"error": f"{exc.__class__.__name__}: {exc}"}
                gather_bytes(ctrl, msgpack.packb(reply))
                continue
            payload = ctrl.broadcast_(torch.empty(payload_len(header), dtype=torch.int64))
            attached = []
            if int(header[ATTACH]):
                blob = ctrl.broadcast_(torch.empty(int(header[ATTACH]), dtype=torch.uint8))
                attached = msgpack.unpackb(bytes(blob.numpy()))
                if tier is not None:  # the tier's copies first: this step's forward may rewrite or read them
                    for item in attached:
                        if isinstance(item, dict) and item.get("kind") == "tier":
                            tier.apply(item["slots"], item["ops"])
                    attached = [a for a in attached if not (isinstance(a, dict) and a.get("kind") == "tier")]
            hook = ext.on_step(attached) if ext is not None else None
            runner.run_step(decode_step(header, payload, runner.device), layer_hook=hook)
            if ext is not None:
                ext.after_step()
    finally:
        if ext is not None:
            ext.close()
        if tier is not None:
            tier.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
