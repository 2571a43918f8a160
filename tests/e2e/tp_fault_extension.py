"""A prefill rank that dies in the middle of a KV write (the rank extension of
test_tp_cluster.py's fault test; engine/tp_rank.py's protocol).

It is the transport every rank runs (kvtransfer/nixl/rank_service.py), except that, while the file
named by $PDSERVE_TEST_KILL_FILE exists, the rank removes it and SIGKILLs its own process right
after posting the first layer of a streamed request: that layer's pages from this rank are on
their way into the decode pool, the other layers never come. The file is gone afterwards, so
the worker Ray restarts runs normally.
"""

from __future__ import annotations

import os
import signal

from pdserve.kvtransfer.nixl.rank_service import RankTransfer

KILL_FILE_ENV = "PDSERVE_TEST_KILL_FILE"


class KillMidStream(RankTransfer):
    def _after_layer(self, layer: int, ready) -> None:
        super()._after_layer(layer, ready)
        path = os.environ.get(KILL_FILE_ENV)
        if self._step_streams and path and os.path.exists(path):
            os.unlink(path)
            os.kill(os.getpid(), signal.SIGKILL)
