"""One rank of a communicator test (tests/engine/test_tensor_parallel.py runs one per rank).

``python tp_comm_peer.py KIND RANK SIZE WHERE SLOT_BYTES OUT``: runs a fixed sequence of
collectives and saves what this rank ended up with to ``OUT`` (a torch file the test
compares across ranks and with the expected values).
"""

import os
import sys

import torch

from pdserve.engine.tp_comm import ProcessGroupComm, ShmComm


def main() -> None:
    kind, rank, size, where, slot, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5]), sys.argv[6]
    torch.set_num_threads(1)
    parent = os.getppid()

    def alive():
        return None if os.getppid() == parent else "the test is gone"

    if kind == "shm":
        comm = ShmComm(where, rank, size, alive, create=rank == 0, slot_bytes=slot, timeout_s=60)
    else:
        comm = ProcessGroupComm("gloo", "127.0.0.1", int(where), rank, size, timeout_s=60)
    gen = torch.Generator().manual_seed(rank)
    # Values whose float sums depend on the order: bit-identical results need one order on all ranks.
    big = torch.randn(3001, 7, generator=gen) * 1e3  # 84 KB: many slots of a small segment
    small = torch.randn(5, generator=gen)
    ints = torch.arange(10, dtype=torch.int64) * (rank + 1)
    mine = {"big": big.clone(), "small": small.clone(), "ints": ints.clone()}
    comm.all_reduce_(big)
    comm.all_reduce_(small)
    comm.all_reduce_(ints)
    gathered = comm.gather(torch.full((1000, 3), float(rank)))
    header = torch.arange(4000, dtype=torch.int64) if rank == 0 else torch.zeros(4000, dtype=torch.int64)
    comm.broadcast_(header)
    if kind == "shm" and rank == 0:
        comm.unlink()
    torch.save({"mine": mine, "big": big, "small": small, "ints": ints, "gathered": gathered,
                "header": header}, out)
    comm.close()


if __name__ == "__main__":
    main()
