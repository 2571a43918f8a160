"""A tensor-parallel rank other than 0: load this rank's shard, then run the steps rank 0 sends.

Started by engine/tp_group.py as ``python -m pdserve.engine.tp_rank SPEC`` (SPEC: JSON with
the engine config, this rank, the group's size and how to reach its communicator). It
schedules nothing and samples nothing: each step it receives the batch
(engine/tp_step.py), plans attention over its own heads, runs its shard (joining the
all-reduces) and sends its logits slice to rank 0. It exits when rank 0 says stop, when
rank 0's process is gone (checked between waits), or on any error (which breaks the group:
rank 0 sees the exit and fails the worker).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    rank, size, parent = spec["rank"], spec["size"], spec["parent"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(name)s: %(message)s")
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    torch.set_num_threads(spec["threads"])

    from .config import EngineConfig, ModelConfig
    from .runner import ModelRunner
    from .tp_comm import ProcessGroupComm, ShmComm
    from .tp_group import STARTUP_TIMEOUT_S
    from .tp_step import HEADER_LEN, OP_STOP, decode_step, payload_len

    def alive() -> str | None:
        if os.getppid() != parent:
            return f"rank 0 (pid {parent}) is gone"
        return None

    cfg = EngineConfig(**spec["config"])
    if spec["comm"] == "shm":
        comm = ShmComm(spec["segment"], rank, size, alive, timeout_s=STARTUP_TIMEOUT_S)
    else:
        comm = ProcessGroupComm(spec["comm"], spec["host"], spec["port"], rank, size, timeout_s=STARTUP_TIMEOUT_S)
    runner = ModelRunner(cfg, ModelConfig.from_dir(cfg.model), rank=rank, comm=comm)
    comm.timeout_s = 120.0
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        comm.broadcast_(header, timeout_s=None)  # idle until the next step (rank 0's liveness checked)
        if int(header[0]) == OP_STOP:
            return 0
        payload = comm.broadcast_(torch.empty(payload_len(header), dtype=torch.int64))
        runner.run_step(decode_step(header, payload, runner.device))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
