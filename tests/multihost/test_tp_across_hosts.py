"""A TP=2 prefill worker on one namespace host serves a TP=1 decode worker on another.

Brought up the way an operator would (`ray up`, then `pdserve up` with a topology whose
prefill role has tensor_parallel_size 2): the prefill worker's two ranks run on the prefill
host, each with its own NIXL agent, and both write their halves of every request's KV
heads across the veth into the decode host's HND pool (UCX on TCP). Requests forced
remote come back as the local path makes them; the pages crossed the link.
"""

from __future__ import annotations

import pytest
from test_cluster_across_hosts import CLUSTER, brought_up, prompt_of


@pytest.fixture(scope="module")
def cluster(llama_dir):
    with brought_up(llama_dir, prefill_tp=2) as mh:
        yield mh


def test_a_tp2_prefill_host_serves_a_tp1_decode_host_token_exact(cluster):
    net = cluster.net
    stats = cluster.stats()
    assert len(stats[f"{CLUSTER}-prefill-0"]["tp_ranks"]) == 1  # rank 1 beside rank 0
    status = cluster.pdserve("status", "--topology", str(cluster.topology), timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert any(line.split()[:3] == ["prefill-0", "prefill", "2"] for line in status.stdout.splitlines()), status.stdout
    # One placement group for the worker's ranks, packed onto the prefill host.
    assert (f"ranks of prefill-0: placement group STRICT_PACK created, 2 bundles (one per rank) on node "
            f"{net['prefill'].addr}") in status.stdout, status.stdout
    prompts = [prompt_of(150 + 16 * i, seed=i) for i in range(4)]
    local = cluster.generate(prompts, route="local")
    tx0, rx0 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]
    remote = cluster.generate(prompts, route="remote")
    after = cluster.stats()
    tx1, rx1 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]
    assert all("error" not in o for o in local + remote), local + remote
    assert [o["token_ids"] for o in remote] == [o["token_ids"] for o in local]
    assert [o["breakdown"]["route"] for o in remote] == ["remote"] * len(prompts)
    written = after[f"{CLUSTER}-prefill-0"]["bytes_written"] - stats[f"{CLUSTER}-prefill-0"]["bytes_written"]
    assert written > 0 and tx1 - tx0 >= written and rx1 - rx0 >= written, (tx1 - tx0, rx1 - rx0, written)
