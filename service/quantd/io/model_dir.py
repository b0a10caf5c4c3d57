"""Model directories (CONTRACT §8): a Hugging Face style directory of weight shards, an optional index,
``config.json``, tokenizer files, ... quantized as one job.

The weight files are every ``*.safetensors`` and PyTorch state dict (``*.bin``, ``*.pt``, ``*.pth``); an
index (``*.index.json``) must name exactly the shards there are and exactly the tensors each holds. Every
other file is copied byte for byte, except ``config.json``, which gains the output format's
``quantization_config``. The output keeps the input's sharding: one output shard per input shard (a PyTorch
shard becomes a ``.safetensors`` one of the same stem, ``pytorch_model*`` named ``model*`` as transformers
looks for it), with the index rewritten for the new tensor names. Tensors are read, quantized and written
one at a time: memory follows the largest tensor, never the model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import shutil
import struct
import time
import unicodedata
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantd.errors import (
    ConfigError,
    JobCancelled,
    MalformedInputError,
    UnsafeInputError,
    UnsupportedFormatError,
)
from quantd_client import Progress, QuantConfig, Report, Summary, TensorReport

from .outputs import ModelStructure, OutputFormat, PlannedTensor, get_format
from .readers import ModelReader, TensorInfo, open_model

log = logging.getLogger("quantd.io")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"
CONFIG = "config.json"
MAX_PATH_CHARS = 1024
NAME_MAX_BYTES = 255  # the longest file or directory name (UTF-8) a filesystem takes (ext4, xfs, APFS, ...)
MAX_JSON_BYTES = 64 * 1024 * 1024  # an index or config.json larger than this is not one


class PathError(ConfigError):
    """A model directory's relative path that is not one (absolute, ``..``, backslash, control characters,
    given twice)."""

    title = "Invalid path in the model directory"
    type_ = "urn:quantd:invalid-path"


def check_relpath(path: str) -> str:
    """``path`` when it is a safe relative POSIX path inside a model directory, else PathError naming it."""
    def bad(why: str) -> PathError:
        return PathError(f"path {path!r}: {why}", field="file")

    if not path:
        raise bad("empty")
    if len(path) > MAX_PATH_CHARS:
        raise bad(f"longer than {MAX_PATH_CHARS} characters")
    if any(unicodedata.category(c)[0] == "C" for c in path):
        raise bad("control characters")
    if "\\" in path:
        raise bad("backslashes (paths are POSIX, '/'-separated)")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise bad("absolute")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise bad("empty, '.' or '..' components")
    if any(len(p.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES for p in parts):
        raise bad(f"a component longer than {NAME_MAX_BYTES} bytes (UTF-8), the longest name a filesystem takes")
    return path


def check_no_folder_clash(paths: Iterable[str], *, field: str = "file") -> None:
    """PathError naming the path when one of ``paths`` is also a folder of another (``a`` beside ``a/b.json``):
    a file and a folder of one name cannot both be written."""
    paths = list(paths)
    folders = {rel.rsplit("/", i)[0]: rel for rel in paths for i in range(1, rel.count("/") + 1)}
    for rel in paths:
        if rel in folders:
            raise PathError(f"path {rel!r}: also a folder of {folders[rel]!r}", field=field)


def directory_digest(file_sha256: Mapping[str, str]) -> str:
    """A model directory's sha256: that of its files' sorted ``path\\0sha256`` lines (an uploaded directory's,
    and a directory source's once its worker has read it)."""
    import hashlib

    lines = "".join(f"{rel}\0{digest}\n" for rel, digest in sorted(file_sha256.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


# A Trainer checkpoint's own state (pickles of its arguments, optimizer, scheduler, scaler and RNG): not weights,
# never loaded (a pickle is only ever read weights-only), copied as they are like the other files.
_TRAINER_STATE = re.compile(r"(training_args\.bin|optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth)")


def is_weight_file(rel: str) -> bool:
    return rel.endswith(WEIGHT_SUFFIXES) and not _TRAINER_STATE.fullmatch(posixpath.basename(rel))


def output_relpath(rel: str) -> str:
    """Where an input weight file's output shard goes (same directory, safetensors)."""
    if rel.endswith(".safetensors"):
        return rel
    head, base = posixpath.split(rel)
    stem = base.rsplit(".", 1)[0]
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model"):]
    return posixpath.join(head, stem + ".safetensors")


def _read_json(path: Path, rel: str) -> Any:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise MalformedInputError(f"{rel}: larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedInputError(f"{rel}: not JSON ({e})") from None
    except RecursionError:
        raise MalformedInputError(f"{rel}: JSON nested too deeply") from None


@dataclass(frozen=True)
class ModelFiles:
    """The files of a model directory: relative path → where its bytes are."""

    files: Mapping[str, Path]

    @classmethod
    def from_dir(cls, root: str | os.PathLike[str]) -> ModelFiles:
        base = Path(root)
        found: dict[str, Path] = {}
        for p in sorted(base.rglob("*")):
            if p.is_file():
                found[check_relpath(p.relative_to(base).as_posix())] = p
        if not found:
            raise MalformedInputError(f"{base}: no files")
        return cls(found)

    @property
    def weights(self) -> list[str]:
        return [r for r in self.files if is_weight_file(r)]

    @property
    def indexes(self) -> list[str]:
        return [r for r in self.files if r.endswith(INDEX_SUFFIX)]

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files.values())


def check_shards(files: ModelFiles, tensors: Mapping[str, Sequence[str]]) -> None:
    """MalformedInputError (422) when the weight files and the index disagree: a tensor in two shards, a
    shard the index names that is missing, a shard it does not name, a tensor it places elsewhere."""
    where: dict[str, str] = {}
    for rel, names in tensors.items():
        for n in names:
            if n in where:
                raise MalformedInputError(f"tensor {n!r} is in two shards: {where[n]!r} and {rel!r}", tensor=n)
            where[n] = rel
    if not files.weights:
        raise MalformedInputError("no weight files (*.safetensors, *.bin, *.pt, *.pth) in the model directory")
    for idx in files.indexes:
        wmap = _read_index(files.files[idx], idx)
        folder = posixpath.dirname(idx)
        named = {posixpath.join(folder, v) for v in wmap.values()}
        kind = idx[: -len(INDEX_SUFFIX)].rsplit(".", 1)[-1]  # safetensors | bin | pt | pth
        for shard in sorted(named):
            if shard not in files.files:
                raise MalformedInputError(f"{idx} names shard {shard!r}, which is not in the upload")
        ours = [w for w in files.weights if w.endswith("." + kind) and posixpath.dirname(w) == folder]
        for shard in ours:
            if shard not in named:
                raise MalformedInputError(f"shard {shard!r} is not named by {idx}")
        for n, shard in wmap.items():
            rel = posixpath.join(folder, shard)
            if where.get(n) != rel:
                actual = f"in {where[n]!r}" if n in where else "in no shard"
                raise MalformedInputError(f"{idx} places tensor {n!r} in {rel!r}, but it is {actual}", tensor=n)
        for shard in ours:
            for n in tensors.get(shard, ()):
                if n not in wmap:
                    raise MalformedInputError(f"tensor {n!r} of {shard!r} is not in {idx}", tensor=n)


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _read_index(path: Path, rel: str) -> dict[str, str]:
    """The weight map of the index ``rel``, its shape checked (MalformedInputError naming the file and the
    field otherwise): a JSON object whose ``weight_map`` is an object of tensor name → shard file and whose
    ``metadata``, when present, is an object (the output's index adds ``total_size`` to it)."""
    data = _read_json(path, rel)
    if not isinstance(data, dict):
        raise MalformedInputError(f"{rel}: must be a JSON object, got {_json_kind(data)}")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise MalformedInputError(f'{rel}: "metadata" must be a JSON object, got {_json_kind(metadata)}')
    wmap = data.get("weight_map")
    if not isinstance(wmap, dict):
        raise MalformedInputError(f'{rel}: "weight_map" must be a JSON object of tensor name → shard file, got '
                                  f"{'nothing' if wmap is None else _json_kind(wmap)}")
    for name, shard in wmap.items():
        if not isinstance(shard, str):
            raise MalformedInputError(f'{rel}: "weight_map" entry {name!r} must be a shard file name (a string), '
                                      f"got {_json_kind(shard)}", tensor=name)
    return wmap


def model_structure(config_path: Path | None, shapes: Iterable[tuple[int, ...]] = ()) -> ModelStructure:
    """The Linear weights of the architecture ``config.json`` names, built on the meta device (no weights,
    never remote code), once the config is checked against the ``shapes`` of the uploaded tensors
    (:func:`~quantd.io.model_skeleton.check_declared_size`). Unknown when there is no config.json,
    transformers is not installed, or it does not implement the architecture: formats then fall back to
    their rule for unknown models."""
    if config_path is None:
        return ModelStructure()
    cfg = _read_json(config_path, CONFIG)
    if not isinstance(cfg, dict):
        raise MalformedInputError(f"{CONFIG}: not a JSON object")
    from .model_skeleton import check_declared_size

    check_declared_size(cfg, shapes)
    with warnings.catch_warnings():  # deprecation notices of modules transformers imports: not the user's concern
        warnings.simplefilter("ignore", DeprecationWarning)
        return _build_structure(cfg)


def _build_structure(cfg: dict[str, Any]) -> ModelStructure:
    try:
        import transformers
        from torch import nn
    except ImportError:
        return ModelStructure(config=cfg)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        return ModelStructure(config=cfg)
    try:
        conf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                                if k not in ("model_type", "auto_map")})
        arch = next((a for a in cfg.get("architectures") or () if isinstance(getattr(transformers, a, None), type)),
                    None)
        with torch.device("meta"):
            model: Any = (getattr(transformers, arch)._from_config(conf) if arch else
                          transformers.AutoModel.from_config(conf, trust_remote_code=False))  # type: ignore[no-untyped-call]
    except Exception as e:  # an architecture this transformers does not build: the format's own rule
        log.warning("config.json: architecture %r not built (%s: %s); Linear weights taken by name",
                    model_type, type(e).__name__, str(e)[:200])
        return ModelStructure(config=cfg)
    modules = frozenset(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear))
    return ModelStructure(linear_modules=modules, config=cfg, base_prefix=getattr(model, "base_model_prefix", ""))


ProgressCallback = Callable[[Progress], None]


def _open_shard(files: ModelFiles, rel: str) -> ModelReader:
    try:
        return open_model(files.files[rel], posixpath.basename(rel))
    except (MalformedInputError, UnsupportedFormatError, UnsafeInputError) as e:  # the same refusal, naming the file
        raise type(e)(f"{rel}: {e.detail}", tensor=e.tensor, field=e.field) from None


def _shard_tensors(files: ModelFiles, config: QuantConfig | None = None) -> dict[str, list[TensorInfo]]:
    """Every weight file's tensors, one file open at a time (a legacy pickle is read whole to list them);
    with ``config``, each file checked as the input of its output format (:func:`~.outputs.gguf.check_format`)."""
    from .outputs.gguf import check_format

    out = {}
    for rel in files.weights:
        with _open_shard(files, rel) as reader:
            if config is not None:
                check_format(reader.format, config)
            out[rel] = list(reader.tensors)
    return out


def plan_directory(files: ModelFiles, config: QuantConfig, calibration: Mapping[str, Any] | None = None, *,
                   folded: frozenset[str] = frozenset()) -> tuple[dict[str, list[Any]], ModelStructure]:
    """Every shard's plan (checked against the index, the output format and ``calibration``, the index of
    the job's calibration file for gptq/awq) before any work: the jobs layer calls this on an upload before
    accepting it. ``folded``: as :func:`quantd.io.pipeline.plan` takes it."""
    from .pipeline import plan

    fmt = get_format(config.output)
    tensors = _shard_tensors(files, config)
    check_shards(files, {rel: [t.name for t in ts] for rel, ts in tensors.items()})
    structure = (model_structure(files.files.get(CONFIG), [t.shape for ts in tensors.values() for t in ts])
                 if fmt.writes_config else ModelStructure())
    plans = {rel: plan(ts, config, calibration, structure=structure, folded=folded) for rel, ts in tensors.items()}
    owner: dict[str, str] = {}
    for ps in plans.values():
        for p in ps:
            for o in p.outputs:
                if o.name in owner:
                    raise ConfigError(f"output tensor {o.name!r} would be written by both {owner[o.name]!r} and "
                                      f"{p.info.name!r}", tensor=p.info.name, field="rules")
                owner[o.name] = p.info.name
    if fmt.writes_config and not any(p.scheme is not None for ps in plans.values() for p in ps):
        reasons = sorted({str(p.reason) for ps in plans.values() for p in ps if p.reason})
        raise ConfigError(f"{config.output} output: no tensor of the model would be quantized, and a checkpoint "
                          f"that declares quantization with no quantized module is not one ({'; '.join(reasons[:3])})",
                          field="output")
    return plans, structure


def _fresh_dir(dst: Path) -> Path:
    """A staging directory beside ``dst`` (renamed onto it at the end); ``dst`` must be absent or empty."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty directory")
    stage = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    return stage


def quantize_directory(src: str | os.PathLike[str] | ModelFiles, dst: str | os.PathLike[str],
                       config: QuantConfig, *, device: str | torch.device, job_id: str | None = None,
                       on_progress: ProgressCallback | None = None,
                       should_cancel: Callable[[], bool] | None = None,
                       calibration: str | os.PathLike[str] | None = None) -> Report:
    """Quantize the model directory ``src`` (a path or its files) into the directory ``dst`` and return the
    Report of every tensor of every shard. ``dst`` is written beside itself and renamed into place at the end
    (nothing is left of a failed or cancelled run). ``calibration``: the layers' inputs for gptq/awq
    (CONTRACT §10), each layer's Hessian built when its weight is quantized; or JSONL lines the model is run
    on, block by block (:mod:`quantd.io.model_calibration`)."""
    from .calibration import MethodCalibration
    from .text_calibration import is_jsonl

    t0 = time.perf_counter()
    files = src if isinstance(src, ModelFiles) else ModelFiles.from_dir(src)
    if calibration is not None and is_jsonl(calibration):  # text the model runs on (CONTRACT §10)
        from .model_calibration import quantize_with_text_calibration

        return quantize_with_text_calibration(files, dst, config, device=device, calibration=calibration,
                                              job_id=job_id, on_progress=on_progress, should_cancel=should_cancel)
    fmt = get_format(config.output)
    dev = torch.device(device)
    stack = contextlib.ExitStack()
    method_cal = None if calibration is None else stack.enter_context(MethodCalibration(calibration))
    with stack:
        plans, structure = plan_directory(files, config, None if method_cal is None else method_cal.index)
        return _quantize_planned(files, dst, config, fmt, dev, plans, structure, t0, job_id=job_id,
                                 on_progress=on_progress, should_cancel=should_cancel, calibration=method_cal)


def _quantize_planned(files: ModelFiles, dst: str | os.PathLike[str], config: QuantConfig, fmt: OutputFormat,
                      dev: torch.device, plans: dict[str, list[Any]], structure: ModelStructure, t0: float, *,
                      job_id: str | None, on_progress: ProgressCallback | None,
                      should_cancel: Callable[[], bool] | None, calibration: Any) -> Report:
    """:func:`quantize_directory` once every shard is planned."""
    from .pipeline import _process

    dst_path = Path(dst)
    stage = _fresh_dir(dst_path)
    try:
        everything = [p for ps in plans.values() for p in ps]
        progress = Progress(tensors_total=len(everything), bytes_total=sum(p.info.nbytes for p in everything))
        if on_progress is not None:
            on_progress(progress)
        reports: list[TensorReport] = []
        written: set[str] = set()
        weight_map: dict[str, str] = {}
        for rel, ps in plans.items():  # one shard open at a time
            out_rel = output_relpath(rel)
            target = stage / out_rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with _open_shard(files, rel) as reader, fmt.open_sink(target, ps) as sink:
                for p in ps:
                    if should_cancel is not None and should_cancel():
                        raise JobCancelled(f"cancelled after {len(reports)} of {len(everything)} tensors")
                    reports.append(_process(reader, sink, fmt, p, dev, calibration))
                    done = progress.bytes_done + p.info.nbytes
                    progress = Progress(tensors_done=len(reports), tensors_total=len(everything),
                                        bytes_done=done, bytes_total=progress.bytes_total,
                                        fraction=done / progress.bytes_total if progress.bytes_total
                                        else len(reports) / len(everything))
                    if on_progress is not None:
                        on_progress(progress)
                was_written = getattr(sink, "written", None)
                names = [o.name for p in ps for o in p.outputs]
                names += [o for o in fmt_optional(fmt, ps) if was_written is not None and was_written(o)]
                written.update(names)
                weight_map.update(dict.fromkeys(names, out_rel))
                sink.finish(None)
        summary = finish_stage(files, stage, dst_path, fmt, everything, structure, reports, written, weight_map,
                               t0=t0, dev=dev)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return Report(job_id=job_id, config=config, summary=summary, tensors=reports)


def finish_stage(files: ModelFiles, stage: Path, dst_path: Path, fmt: OutputFormat, everything: Sequence[PlannedTensor],
                 structure: ModelStructure, reports: list[TensorReport], written: Collection[str],
                 weight_map: Mapping[str, str], *, t0: float, dev: torch.device) -> Summary:
    """The end of a directory job whose shards are written into ``stage``: the directory's other files and
    the format's quantization config beside them, the run's summary, and ``stage`` moved to ``dst_path``."""
    from .pipeline import summarize

    _write_other_files(files, stage, fmt.quantization_config(everything, structure, written=written),
                       weight_map, writes_config=fmt.writes_config)
    out_bytes = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
    summary = summarize(everything, reports, files.total_bytes, out_bytes, time.perf_counter() - t0, dev)
    if dst_path.exists():
        dst_path.rmdir()
    os.replace(stage, dst_path)
    return summary


def fmt_optional(fmt: OutputFormat, plans: Sequence[PlannedTensor]) -> list[str]:
    """The names of the optional output tensors a format may write for these plans."""
    return [o.name for p in plans if p.scheme is not None
            for o in fmt.optional_layout(p.info.name, p.info.shape, p.scheme)]


def _tensor_bytes(path: Path) -> int:
    """A safetensors file's tensor data in bytes (its size less the header): what an index's ``total_size``
    counts, as transformers writes it."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - int(n)


def _write_other_files(files: ModelFiles, stage: Path, qconfig: dict[str, Any] | None,
                       weight_map: Mapping[str, str], *, writes_config: bool) -> None:
    """Copy every file that is not a weight file, rewrite the index(es) and complete config.json."""
    total = sum(_tensor_bytes(p) for p in stage.rglob("*.safetensors"))
    for rel, path in files.files.items():
        if is_weight_file(rel):
            continue
        target = stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(INDEX_SUFFIX):
            data = _read_json(path, rel)
            folder = posixpath.dirname(rel)
            new_rel = output_relpath(rel[: -len(INDEX_SUFFIX)]) + INDEX_SUFFIX
            data["metadata"] = {**(data.get("metadata") or {}), "total_size": total}
            data["weight_map"] = {n: posixpath.basename(shard) for n, shard in sorted(weight_map.items())
                                  if posixpath.dirname(shard) == folder}
            (stage / new_rel).write_text(json.dumps(data, indent=2) + "\n")
        elif rel == CONFIG and qconfig is not None:
            data = _read_json(path, rel)
            data["quantization_config"] = qconfig
            target.write_text(json.dumps(data, indent=2) + "\n")
        else:
            shutil.copyfile(path, target)
    if writes_config and qconfig is not None and CONFIG not in files.files:
        (stage / CONFIG).write_text(json.dumps({"quantization_config": qconfig}, indent=2) + "\n")


def iter_output_files(root: Path) -> Iterator[tuple[str, Path]]:
    """The files of an output directory, relative POSIX path first, in sorted order."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            yield p.relative_to(root).as_posix(), p


# --- a directory as one file: an uncompressed tar (uploads kept by the jobs layer, directory artifacts) ---

_TAR_CHUNK = 1 << 20


class _HashingReader:
    """A file's ``read`` that hashes what it returns (tarfile copies a member through it)."""

    def __init__(self, f: Any, h: Any) -> None:
        self.f, self.hash = f, h

    def read(self, n: int = -1) -> bytes:
        b: bytes = self.f.read(n)
        self.hash.update(b)
        return b


def pack_tar(files: Iterator[tuple[str, Path]] | Sequence[tuple[str, Path]], dst: Path) -> list[dict[str, Any]]:
    """Write ``files`` (relative path, source) into the uncompressed tar ``dst`` (deterministic: no
    timestamps or owners), fsynced; returns ``[{"path","bytes","sha256"}]``, hashed while copied."""
    import hashlib
    import tarfile

    manifest = []
    with open(dst, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, src in files:
            size = src.stat().st_size
            info = tarfile.TarInfo(check_relpath(rel))
            info.size, info.mode, info.mtime = size, 0o644, 0
            with open(src, "rb") as f:
                reader = _HashingReader(f, hashlib.sha256())
                tar.addfile(info, reader)
            manifest.append({"path": rel, "bytes": size, "sha256": reader.hash.hexdigest()})
        tar.close()
        raw.flush()
        os.fsync(raw.fileno())
    return manifest


def unpack_tar(src: Path, dst: Path) -> ModelFiles:
    """Extract a tar written by :func:`pack_tar` into ``dst`` (regular files at checked relative paths only)."""
    import tarfile

    found: dict[str, Path] = {}
    with tarfile.open(src, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                raise MalformedInputError(f"stored directory: {member.name!r} is not a regular file")
            rel = check_relpath(member.name)
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fobj = tar.extractfile(member)
            if fobj is None:
                raise MalformedInputError(f"stored directory: {rel!r} cannot be read")
            with fobj, open(target, "wb") as out:
                shutil.copyfileobj(fobj, out, _TAR_CHUNK)
            found[rel] = target
    return ModelFiles(found)


_READ_AHEAD = 64 * 1024


class _RangeFile:
    """A read-only, seekable file over ``read(start, length)`` (a local file or an object store's ranged
    GETs), for tarfile to walk the headers of an uncompressed tar without reading its members."""

    def __init__(self, read: Callable[[int, int], bytes], size: int) -> None:
        self._read, self._size, self._pos = read, size, 0
        self._block, self._block_start = b"", 0  # small reads (headers) come out of one read-ahead block

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        if n > _READ_AHEAD:
            data = self._read(self._pos, n)
        else:
            off = self._pos - self._block_start
            if off < 0 or off + n > len(self._block):  # one ranged read covers this and the headers after it
                self._block_start, off = self._pos, 0
                self._block = self._read(self._pos, min(_READ_AHEAD, self._size - self._pos))
            data = self._block[off:off + n]
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos


def tar_window(read: Callable[[int, int], bytes], size: int, rel: str) -> tuple[int, int] | None:
    """Where the bytes of member ``rel`` lie in an uncompressed tar of ``size`` bytes read through ``read``:
    ``(offset, size)``; None when it has no such member. Reads the headers only."""
    import tarfile

    with tarfile.open(fileobj=_RangeFile(read, size), mode="r:") as tar:  # type: ignore[call-overload]
        for member in tar:
            if member.name == rel and member.isfile():
                return member.offset_data, member.size
    return None
