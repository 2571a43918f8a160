"""Behind a gateway without API keys, a decode worker still sees each client as a tenant of its
own: the gateway names its client by address (``x-pdserve-tenant: addr:...``), and the worker,
which has no key to trust either, believes it because the gateway calls from a trusted proxy
address (FORWARDED_ALLOW_IPS, loopback by default; api/security.py). The gateway bounds the
client by its address too. Real etcd, worker and gateway on loopback; the client connects
from 127.0.0.2 through the official `openai` SDK."""

from __future__ import annotations

import openai
import pytest

from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until

try:  # the HTTP library this openai release is built on (httpx2 in recent ones), for its transport
    import httpx2 as sdk_http
except ImportError:  # pragma: no cover  (older releases: httpx)
    import httpx as sdk_http

CLIENT = "127.0.0.2"  # not the gateway's own address (127.0.0.1): the worker must learn it from the gateway


@pytest.fixture(scope="module")
def behind_gateway(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwtenant")
    (tmp / "router.yaml").write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        w = gw = None
        try:
            w = WorkerThread(DecodeWorkerConfig(
                model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="gwtenant", lease_ttl_s=3,
                worker_id="decode-0", router_policy=str(tmp / "router.yaml"), host="127.0.0.1")).start()
            gw = GatewayThread(GatewayConfig([etcd.endpoint], "gwtenant", model=llama_dir, host="127.0.0.1")).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == 1, 20)
            yield w, gw
        finally:
            if gw is not None:
                gw.stop()
            if w is not None:
                w.stop()


def test_the_worker_sees_the_gateways_client_by_its_address(behind_gateway):
    w, gw = behind_gateway
    tenant = f"addr:{CLIENT}"
    http = openai.DefaultHttpxClient(transport=sdk_http.HTTPTransport(local_address=CLIENT))
    with openai.OpenAI(base_url=f"http://{gw.gateway.http_address}/v1", api_key="not-used", max_retries=0,
                       timeout=120, http_client=http) as client:
        stream = client.completions.create(model="llama", prompt="A long story begins", max_tokens=450,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices
        assert gw.gateway.frontend.sequences_per_key == {tenant: 1}  # the gateway's own per-client share
        assert w.worker.frontend.sequences_per_key == {tenant: 1}  # the worker's, through the header
        assert [r.tenant for r in list(w.worker.engine.requests.values())] == [tenant]  # the scheduler's turns
        stream.close()
    eng = w.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks
               and not w.worker.frontend.sequences_per_key and not w.worker.frontend.tokens_per_tenant
               and not gw.gateway.frontend.sequences_per_key, 15)
