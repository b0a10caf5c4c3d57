"""Settings: QUANTD_* environment, defaults, and the combinations refused at startup."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from quantd.server.settings import GiB, MiB, Settings, SettingsError, parse_api_keys


def test_defaults_and_environment(monkeypatch):
    s = Settings()
    assert (s.host, s.port, s.max_upload_bytes, s.max_sync_bytes) == ("127.0.0.1", 8000, 10 * GiB, 256 * MiB)
    assert s.data_dir == Path("quantd-data") and s.embedded_workers and s.workers is None
    monkeypatch.setenv("QUANTD_PORT", "9001")
    monkeypatch.setenv("QUANTD_MAX_SYNC_BYTES", "1000")
    monkeypatch.setenv("QUANTD_WORKERS", "0")
    monkeypatch.setenv("QUANTD_LOG_LEVEL", "debug")
    monkeypatch.setenv("QUANTD_API_KEYS", "team-a:abcdefgh1,team-b:abcdefgh2")
    s = Settings()
    assert (s.port, s.max_sync_bytes, s.workers, s.log_level) == (9001, 1000, 0, "DEBUG")
    assert s.tenant_keys() == {"abcdefgh1": "team-a", "abcdefgh2": "team-b"}
    assert "abcdefgh1" not in repr(s)  # the keys are secret in reprs and logs


@pytest.mark.parametrize("spec, fragment", [
    ("nocolon", "not 'tenant:key'"),
    ("bad tenant!:abcdefgh1", "tenant name"),
    ("a:abcdefgh1,b:abcdefgh1", "two tenants"),
])
def test_malformed_api_keys_are_refused(spec, fragment):
    with pytest.raises(SettingsError, match=fragment):
        parse_api_keys(spec)
    with pytest.raises(ValidationError):
        Settings(api_keys=spec)


def test_the_contracts_example_keys_are_accepted(caplog):
    # CONTRACT §3: QUANTD_API_KEYS="tenant-a:key1,tenant-b:key2" (short keys: a warning, not a refusal)
    settings = Settings(api_keys="tenant-a:key1,tenant-b:key2")
    assert settings.tenant_keys() == {"key1": "tenant-a", "key2": "tenant-b"}
    with caplog.at_level("WARNING", logger="quantd.server"):
        settings.warn_unsafe()
    assert "easy to guess" in caplog.text and "tenant-a, tenant-b" in caplog.text
    assert "key1" not in caplog.text  # the keys themselves are never logged


def test_keys_file_with_comments_and_newlines(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops\nteam-a:abcdefgh1\n\nteam-c:abcdefgh3\n")
    assert Settings(api_keys_file=f, api_keys="team-b:abcdefgh2").tenant_keys() == {
        "abcdefgh1": "team-a", "abcdefgh3": "team-c", "abcdefgh2": "team-b"}
    with pytest.raises(ValidationError, match="not a readable file"):
        Settings(api_keys_file=tmp_path / "missing")


def test_unsafe_combinations_fail_fast():
    with pytest.raises(ValidationError, match="max_sync_bytes"):
        Settings(max_upload_bytes=100, max_sync_bytes=200)
    with pytest.raises(ValidationError, match="device"):
        Settings(device="tpu")
    with pytest.raises(ValidationError):
        Settings(workers=-1)


def test_open_mode_on_a_public_address_warns_loudly(caplog):
    with caplog.at_level(logging.INFO, logger="quantd.server"):
        Settings(host="0.0.0.0").warn_unsafe()
        Settings(host="127.0.0.1").warn_unsafe()
        Settings(host="0.0.0.0", api_keys="a:abcdefgh1abcdefgh1").warn_unsafe()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "OPEN MODE" in warnings[0].getMessage()
    assert sum("open mode" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO) == 1
