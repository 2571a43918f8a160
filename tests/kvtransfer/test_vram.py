"""VRAM registration: the same page writes between two processes sharing one CUDA GPU."""

from __future__ import annotations

import pytest
from kvt_peer import (
    PeerProcess,
    assert_pool_equal,
    connect,
    expected_pool,
    llama8b,
    mapping,
    open_agent,
    snapshot,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_vram_pages_land_byte_exact_between_two_processes_on_one_gpu(spawn_ctx, dtype):
    send_layout, recv_layout = llama8b(dtype, 64), llama8b(dtype, 96)
    sender, receiver = PeerProcess(spawn_ctx, "g0"), PeerProcess(spawn_ctx, "g1")
    try:
        assert open_agent(sender, send_layout, seed=21, device="cuda")["pool"]["mem_type"] == "VRAM"
        open_agent(receiver, recv_layout, seed=22, device="cuda")
        peer = connect(sender, receiver)
        local, remote = mapping("runs", 48, 64, 96, seed=4)
        sender.ok("write", peer=peer, local=local, remote=remote)  # warm-up: wireup, IPC handles

        reply = sender.ok("write", peer=peer, local=local, remote=remote, timeout_s=10.0)

        print(f"VRAM->VRAM, two processes on one GPU: {reply['num_bytes'] / reply['elapsed_s'] / 1e9:.1f} "
              f"GB/s ({reply['num_bytes'] >> 20} MiB, {reply['num_descriptors']} descriptors)")
        expected = expected_pool((recv_layout, 22), [(send_layout, 21, local, remote)])
        assert_pool_equal(snapshot(receiver), expected)
    finally:
        exit_codes = (sender.stop(), receiver.stop())
    assert exit_codes == (0, 0)
