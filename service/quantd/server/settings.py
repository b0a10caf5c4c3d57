"""Server settings: one ``Settings`` read from ``QUANTD_*`` variables, checked once at startup.

The data directory defaults to ``./quantd-data`` (relative to the working directory) so a first
``quantd serve`` keeps everything next to where it was started; containers set ``QUANTD_DATA_DIR=/data``.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from quantd.jobs.config import DEVICE_RE
from quantd.runtime import KEEP_FREED_MEMORY_DEFAULT

log = logging.getLogger("quantd.server")

GiB = 1024**3
MiB = 1024**2
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# Keys shorter than this are accepted with a warning at start-up (Settings.warn_unsafe).
MIN_SAFE_KEY_LENGTH = 16


class SettingsError(ValueError):
    """A settings value, or a combination of them, that the server refuses to start with."""


def parse_api_keys(spec: str, *, source: str = "QUANTD_API_KEYS") -> dict[str, str]:
    """``"tenant-a:key1,tenant-b:key2"`` (commas or newlines; ``#`` comments) → ``{key: tenant}``."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(re.split(r"[,\n]", spec), start=1):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        tenant, sep, key = item.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not tenant or not key:
            raise SettingsError(f"{source}: entry {n} is not 'tenant:key'")
        if not _TENANT_RE.match(tenant):
            raise SettingsError(f"{source}: entry {n}: tenant name {tenant!r} must match {_TENANT_RE.pattern}")
        if key in keys and keys[key] != tenant:
            raise SettingsError(f"{source}: entry {n}: the same key is given to two tenants")
        keys[key] = tenant
    return keys


def parse_source_prefixes(spec: str) -> tuple[tuple[str, str], ...]:
    """``"tenant-a=s3://b/x/,*=s3://b/shared/"`` → ``(("tenant-a", "s3://b/x/"), ("*", "s3://b/shared/"))``.
    Prefixes are s3:// URLs ending in ``/`` (a prefix ``s3://b/x`` would also grant ``s3://b/xy``)."""
    from quantd.jobs.backends.s3 import parse_s3_url
    from quantd.jobs.errors import StorageError

    out: list[tuple[str, str]] = []
    for n, raw in enumerate(spec.split(","), start=1):
        item = raw.strip()
        if not item:
            continue
        tenant, sep, prefix = item.partition("=")
        tenant, prefix = tenant.strip(), prefix.strip()
        if not sep or not (tenant == "*" or _TENANT_RE.match(tenant)):
            raise SettingsError(f"QUANTD_SOURCE_PREFIXES: entry {n} is not 'tenant=s3://bucket/prefix/'")
        if not prefix.endswith("/"):
            raise SettingsError(f"QUANTD_SOURCE_PREFIXES: entry {n}: {prefix!r} must end with '/'")
        try:
            parse_s3_url(prefix)
        except StorageError as e:
            raise SettingsError(f"QUANTD_SOURCE_PREFIXES: entry {n}: {e}") from None
        out.append((tenant, prefix))
    return tuple(out)


class Settings(BaseSettings):
    """Every field reads ``QUANTD_<NAME>`` (e.g. ``QUANTD_MAX_UPLOAD_BYTES``)."""

    model_config = SettingsConfigDict(env_prefix="QUANTD_", extra="ignore", validate_default=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    data_dir: Path = Path("quantd-data")
    workers: int | None = Field(default=None, ge=0, le=64, description=(
        "workers: unset = one per CUDA device (one CPU worker without CUDA); 0 = API only (serve)"))
    device: str = "auto"
    api_keys: SecretStr | None = None
    api_keys_file: Path | None = None
    max_upload_bytes: int = Field(default=10 * GiB, ge=1)
    max_sync_bytes: int = Field(default=256 * MiB, ge=1)
    max_queue: int = Field(default=1000, ge=1)
    job_ttl_s: float = Field(default=7 * 24 * 3600, gt=0, description="finished jobs and their files are kept this long")
    lease_s: float = Field(default=60.0, gt=0, description="a running job whose worker stops heartbeating for this long is re-queued")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    embedded_workers: bool = True
    sse_keepalive_s: float = Field(default=15.0, gt=0)
    sync_concurrency: int = Field(default=2, ge=1, description="sync /v1 engine calls running at once")
    quantize_during_upload: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "quantize a safetensors job upload tensor by tensor while it streams in (when its config comes "
        "first and an embedded worker is idle); auto = on when the workers use CUDA (on CPU workers it "
        "competes with receiving the upload for the cores)"))
    keep_freed_memory: bool = Field(default=KEEP_FREED_MEMORY_DEFAULT, description=(
        "glibc malloc: blocks up to 1 GiB come from one heap for all threads, and freed memory stays there for "
        "the next tensors (up to 1 GiB at the heap's top, and the holes below it), instead of each large tensor "
        "being mapped anew (its pages faulted in) and given back"))
    warmup: bool = Field(default=True, description=(
        "compile the engine's CPU kernels for the common schemes in the background at start; requests and "
        "jobs run on the eager path until it ends (never waiting on a compile), and /readyz reports it"))
    warmup_gguf: bool = Field(default=True, description=(
        "after that warm-up, build the GGUF k-quant searches' kernels too where GGUF jobs run on CPU (minutes "
        "on a cold kernel cache, under a minute from the cache in the data dir); GGUF jobs run eager until they "
        "are built, then compiled (with QUANTD_COMPILE=auto a server compiles them in no other case)"))

    database_url: SecretStr | None = Field(default=None, description=(
        "the job store: sqlite:///PATH (default: quantd.db in the data dir) or postgresql://USER:PASSWORD@HOST/DB, "
        "shared by every API replica and worker process"))
    storage_url: str | None = Field(default=None, description=(
        "the file store: file:///PATH (default: the data dir) or s3://BUCKET/PREFIX (credentials and region from "
        "the AWS_* variables; the data dir is then local scratch)"))
    s3_endpoint_url: str | None = Field(default=None, description=(
        "an S3-compatible endpoint (MinIO, Ceph RGW, GCS): http(s)://HOST:PORT; default: AWS or AWS_ENDPOINT_URL"))
    storage_presign: bool = Field(default=False, description=(
        "artifacts in an object store are answered with a 307 redirect to a presigned URL instead of being "
        "streamed through the API"))
    db_migrate: bool = Field(default=True, description=(
        "apply pending database migrations at start (they are additive and serialised between processes by a "
        "lock); off: refuse to start on an old schema, and run `quantd db upgrade` yourself"))
    source_prefixes: str | None = Field(default=None, description=(
        "jobs by reference: the s3:// prefixes each tenant may read and write, 'tenant=s3://bucket/prefix/' "
        "separated by commas ('*=' for every tenant); none = no job by reference"))

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @field_validator("quantize_during_upload", mode="before")
    @classmethod
    def _on_off(cls, v: object) -> object:
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, str):
            return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
                v.strip().lower(), v.strip().lower())
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.fullmatch(v):
            raise ValueError("device must be auto, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> Settings:
        if self.max_sync_bytes > self.max_upload_bytes:
            raise ValueError(f"max_sync_bytes ({self.max_sync_bytes}) must not exceed "
                             f"max_upload_bytes ({self.max_upload_bytes})")
        if self.api_keys is not None:
            parse_api_keys(self.api_keys.get_secret_value())
        if self.source_prefixes is not None:
            parse_source_prefixes(self.source_prefixes)
        database_url = None if self.database_url is None else self.database_url.get_secret_value()
        for name, url, schemes in (("database_url", database_url, ("sqlite://", "postgresql://", "postgres://")),
                                   ("storage_url", self.storage_url, ("file://", "s3://"))):
            if url is not None and not url.startswith(schemes):
                raise ValueError(f"{name} must start with one of {list(schemes)}")
        needs = {"psycopg": database_url is not None and database_url.startswith("postgres"),
                 "boto3": (self.storage_url or "").startswith("s3://") or bool(self.source_prefixes)}
        for package, needed in needs.items():
            if needed and importlib.util.find_spec(package) is None:
                raise ValueError(f"the PostgreSQL and S3 backends need {package}: pip install 'quantd[scale]'")
        if self.api_keys_file is not None:
            if not self.api_keys_file.is_file():
                raise ValueError(f"api_keys_file {str(self.api_keys_file)!r} is not a readable file")
            parse_api_keys(self.api_keys_file.read_text(), source="QUANTD_API_KEYS_FILE")
        return self

    def tenant_keys(self) -> dict[str, str]:
        """``{key: tenant}`` from QUANTD_API_KEYS and QUANTD_API_KEYS_FILE together; empty = open mode."""
        keys: dict[str, str] = {}
        if self.api_keys is not None:
            keys.update(parse_api_keys(self.api_keys.get_secret_value()))
        if self.api_keys_file is not None:
            keys.update(parse_api_keys(self.api_keys_file.read_text(), source="QUANTD_API_KEYS_FILE"))
        return keys

    @property
    def tmp_dir(self) -> Path:
        """This process's scratch folder under ``data_dir/tmp`` (:mod:`quantd.jobs.scratch`), the storage's."""
        from quantd.jobs.scratch import process_dir

        return process_dir(self.data_dir / "tmp")

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def warn_unsafe(self) -> None:
        """Log loudly what is allowed but unsafe: an open server on a non-loopback address, and short keys
        (allowed: CONTRACT §3's own example keys are 4 characters)."""
        keys = self.tenant_keys()
        short = sorted({tenant for key, tenant in keys.items() if len(key) < MIN_SAFE_KEY_LENGTH})
        if short:
            log.warning("API keys shorter than %d characters (tenants %s) are easy to guess; use long random keys "
                        "outside tests", MIN_SAFE_KEY_LENGTH, ", ".join(short))
        if not keys:
            if self.is_loopback():
                log.info("open mode: no API keys configured; every caller is tenant 'default'")
            else:
                log.warning("OPEN MODE ON A PUBLIC ADDRESS: host %s with no API keys; anyone who can reach "
                            "port %d can upload and run jobs. Set QUANTD_API_KEYS or QUANTD_API_KEYS_FILE.",
                            self.host, self.port)
