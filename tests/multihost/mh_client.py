"""Run inside a test host (``python mh_client.py '<json>'``): a client of a multi-host cluster.

It connects to the cluster's Ray as a driver (worker stats) and to a decode worker over
gRPC (requests), and prints one JSON line ``RESULT=...`` with what the test asserts on.
Ops: "stats" (decode and prefill worker stats), "generate" (requests, token ids back),
"wait_member" (poll etcd until a worker is present or gone; how long it took).
"""

from __future__ import annotations

import asyncio
import json
import sys


def stats(args: dict) -> dict:
    import ray

    ray.init(address=args["ray"], namespace=args["namespace"], logging_level="ERROR", log_to_driver=False)
    out = {}
    for name, method in args["actors"].items():
        out[name] = ray.get(getattr(ray.get_actor(name, namespace=args["namespace"]), method).remote(), timeout=60)
    return out


def generate(args: dict) -> dict:
    from pdserve.api import AsyncClient

    async def go():
        async with AsyncClient(args["target"]) as c:
            outs = await asyncio.gather(*(
                c.generate(p, max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True, route=args["route"],
                           priority="high", timeout_s=args.get("timeout_s", 120)) for p in args["prompts"]),
                return_exceptions=True)
        return [{"error": repr(o)} if isinstance(o, BaseException) else
                {"token_ids": list(o.token_ids), "breakdown": dict(o.breakdown)} for o in outs]

    return {"outs": asyncio.run(go())}


def wait_member(args: dict) -> dict:
    """Poll etcd until worker `worker` is present (or absent); seconds it took, or None on timeout."""
    import time

    from pdserve.cluster.registry import Registry

    async def go():
        t0 = time.monotonic()
        async with Registry(args["etcd"], args["cluster"]) as reg:
            while time.monotonic() - t0 < args["timeout_s"]:
                if (args["worker"] in await reg.members()) == args["present"]:
                    return time.monotonic() - t0
                await asyncio.sleep(0.1)
        return None

    return {"elapsed_s": asyncio.run(go())}


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    result = {"stats": stats, "generate": generate, "wait_member": wait_member}[request.pop("op")](request)
    print("RESULT=" + json.dumps(result, default=str))
