"""KV transfer across hosts vs on one host, side by side: NIXL page writes over UCX/TCP.

Two processes (a prefill-side sender, a decode-side receiver that polls its agent like
a decode worker's step loop) write Llama-3-8B-shaped KV pages (2 MiB per block across
32 layers, fp16), in three placements measured in one run, interleaved:

  same host, shm     both in one host, UCX free to choose (shared memory): what a one-host
                     cluster gets
  same host, tcp     both in one host, UCX_TLS=tcp over lo
  two hosts, tcp     sender and receiver in two hosts (network namespaces joined by a
                     veth bridge), UCX_TLS=tcp over eth0: what crosses a real link

Needs root (it makes the namespace hosts, bench/netns.py, and removes them after).
Latency is from the write call to completion seen by the sender.

    sudo python bench/hosts.py [--blocks 16,64,256] [--reps 1.0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

PLACEMENTS = ("same host, shm", "same host, tcp", "two hosts, tcp")
POOL_BLOCKS = 288
BASE_REPS = {16: 20, 64: 10, 256: 4}
REPLY_TIMEOUT_S = 180.0


def _layout(num_blocks: int):
    from pdserve.kvtransfer.nixl import KVLayout

    return KVLayout("llama-3-8b", "float16", num_layers=32, num_blocks=num_blocks, block_size=16,
                    num_kv_heads=8, head_dim=128)


def _peer(conn, netns: str | None, ucx_env: dict, name: str) -> None:
    """Child: enter its host, own one pool and agent, obey the parent (plain dicts)."""
    if netns:
        from pdserve.bench.netns import enter_netns

        enter_netns(netns)
    os.environ.update(ucx_env)
    import torch

    from pdserve.kvtransfer.nixl import KVTransferAgent

    layout = _layout(POOL_BLOCKS)
    kv = torch.zeros(layout.shape, dtype=torch.float16)
    agent = KVTransferAgent(name, kv, layout, ucx_env=ucx_env)
    conn.send({"info": agent.local_info()})
    peer = None
    while True:
        while not conn.poll(0.001):
            agent.poll()  # a receiver's step loop keeps NIXL progressing
        cmd = conn.recv()
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "connect":
            peer = agent.add_peer(cmd["info"])
            conn.send({})
        elif cmd["op"] == "write":
            n = cmd["blocks"]
            samples = []
            for _ in range(cmd["reps"]):
                t0 = time.perf_counter()
                agent.wait(agent.write_blocks(peer, list(range(n)), list(range(n))), 60.0)
                samples.append(time.perf_counter() - t0)
            conn.send({"samples": samples, "bytes": n * layout.num_layers * layout.block_bytes})
    agent.close()
    conn.send({"closed": True})


class _Pair:
    def __init__(self, ctx, send_ns, recv_ns, env):
        self.procs, self.conns = [], []
        for ns, name in ((send_ns, "sender"), (recv_ns, "receiver")):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_peer, args=(child, ns, env, f"{name}-{os.getpid()}"), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        infos = [self._recv(c) for c in self.conns]
        self.conns[0].send({"op": "connect", "info": infos[1]["info"]})
        self._recv(self.conns[0])

    @staticmethod
    def _recv(conn) -> dict:
        if not conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError("a transfer process gave no answer")
        return conn.recv()

    def write(self, blocks: int, reps: int) -> dict:
        self.conns[0].send({"op": "write", "blocks": blocks, "reps": reps})
        return self._recv(self.conns[0])

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send({"op": "exit"})
                self._recv(c)
            except (OSError, TimeoutError, EOFError):
                pass
            p.join(10)
            if p.is_alive():
                p.kill()


def run(blocks: list[int], reps_scale: float, progress=print) -> list[dict]:
    from pdserve.bench.netns import Network, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"bench/hosts.py {why}")
    ctx = multiprocessing.get_context("spawn")
    base = {"UCX_MODULES": "^ib"}
    envs = {"same host, shm": {**base, "UCX_NET_DEVICES": "lo"},
            "same host, tcp": {**base, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
            "two hosts, tcp": {**base, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}}
    rows = []
    with Network(["solo", "a", "b"]) as net:
        pairs = {}
        try:
            pairs["same host, shm"] = _Pair(ctx, net["solo"].netns, net["solo"].netns, envs["same host, shm"])
            pairs["same host, tcp"] = _Pair(ctx, net["solo"].netns, net["solo"].netns, envs["same host, tcp"])
            pairs["two hosts, tcp"] = _Pair(ctx, net["a"].netns, net["b"].netns, envs["two hosts, tcp"])
            for n in blocks:
                reps = max(2, int(BASE_REPS.get(n, 8) * reps_scale))
                samples = {k: [] for k in PLACEMENTS}
                nbytes = 0
                for _ in range(reps):  # interleaved: the placements see the same machine state
                    for k in PLACEMENTS:
                        out = pairs[k].write(n, 1)
                        samples[k] += out["samples"]
                        nbytes = out["bytes"]
                for k in PLACEMENTS:
                    med = statistics.median(samples[k])
                    rows.append({"placement": k, "blocks": n, "tokens": n * 16, "bytes": nbytes, "reps": reps,
                                 "median_ms": med * 1e3, "gb_per_s": nbytes / med / 1e9})
                progress(f"{n} blocks done")
        finally:
            for p in pairs.values():
                p.close()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'request':>20} | " + " | ".join(f"{k:>22}" for k in PLACEMENTS) + " | two hosts / same host tcp")
    for n in sorted({r["blocks"] for r in rows}):
        by = {r["placement"]: r for r in rows if r["blocks"] == n}
        mb = by[PLACEMENTS[0]]["bytes"] / 2**20
        cells = " | ".join(f"{by[k]['median_ms']:8.1f} ms {by[k]['gb_per_s']:6.2f} GB/s" for k in PLACEMENTS)
        ratio = by["two hosts, tcp"]["median_ms"] / by["same host, tcp"]["median_ms"]
        print(f"{n:>4} blocks ({mb:5.0f} MiB) | {cells} | {ratio:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256],
                        help="request sizes in 16-token blocks (2 MiB each), comma-separated (default 16,64,256)")
    parser.add_argument("--reps", type=float, default=1.0, help="scale the repetition counts")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if any(b > POOL_BLOCKS for b in args.blocks):
        parser.error(f"--blocks: at most {POOL_BLOCKS} per request")
    rows = run(args.blocks, args.reps, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
