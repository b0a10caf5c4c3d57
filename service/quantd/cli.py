"""The ``quantd`` command (also ``python -m quantd``).

Client commands (``jobs``, ``info``, and ``quantize``/``analyze`` with ``--server``) need only the
bare install: torch, fastapi and the server modules are imported inside the subcommands that run
them in-process, never at module import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_args

from quantd_client._dtypes import DIRECTORY_OUTPUT_FORMATS, GGUF_MIXES, OUTPUT_FORMATS
from quantd_client._schemas import (
    AnalysisName,
    AnalyzeResponse,
    DType,
    GranularityName,
    JobStatus,
    MethodArg,
    MethodName,
    ObserverName,
    QuantConfig,
    Report,
    Scheme,
    SchemeOverride,
    Summary,
)

DEFAULT_ANALYZE_DTYPES = ("int8", "int4")


T = TypeVar("T")


class UsageError(Exception):
    """A bad flag value or config: exit status 2."""


# What the server extra adds to the SDK-only install (a missing one: "install quantd[server]").
SERVER_PACKAGES = frozenset({"torch", "fastapi", "uvicorn", "safetensors", "pydantic_settings", "starlette",
                             "quantd"})


class JobFailed(Exception):
    """A job on the server that failed or was cancelled: exit status 1."""


# -- output ---------------------------------------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6) else f"{v:.4g}"
    return str(v)


def _cosine(v: float | None) -> str | None:
    """Cosines to 6 decimals: at 4 significant digits an int8 tensor's 0.99998 read as 1."""
    return None if v is None else f"{v:.6f}"


def format_summary(s: Summary) -> str:
    return table(["summary", "value"], [
        ["tensors quantized", s.tensors_quantized], ["tensors skipped", s.tensors_skipped],
        ["input bytes", s.input_bytes], ["output bytes", s.output_bytes],
        ["compression ratio", s.compression_ratio], ["bits/weight", s.bits_per_weight],
        ["mean SQNR dB", s.mean_sqnr_db], ["min SQNR dB", s.min_sqnr_db], ["worst tensor", s.worst_tensor],
        ["elapsed s", s.elapsed_s], ["device", s.device]])


def format_report(r: Report) -> str:
    rows = []
    for t in r.tensors:
        st = t.stats
        scheme = f"{t.scheme.dtype}/{t.scheme.granularity}" if t.scheme else f"skipped: {t.reason}"
        rows.append([t.name, "x".join(map(str, t.shape)), scheme, st.sqnr_db if st else None,
                     st.mse if st else None, _cosine(st.cosine) if st else None, st.bits_per_weight if st else None])
    return table(["tensor", "shape", "scheme", "SQNR dB", "MSE", "cosine", "bits/w"], rows) + "\n\n" + \
        format_summary(r.summary)


def scheme_label(s: Scheme) -> str:
    g = {"group": f"g{s.group_size}", "channel": "ch", "tensor": "t"}[s.granularity]
    return f"{s.dtype}/{g}/{'sym' if s.symmetric else 'asym'}"


def overall(resp: AnalyzeResponse, k: int) -> dict[str, float | None]:
    """Numel-weighted totals of scheme ``k``: SQNR from summed signal and error energy."""
    n = err = sig = cos = bpw = 0.0
    for t in resp.tensors:
        st = t.results[k].stats
        n += st.numel
        err += st.mse * st.numel
        sig += (st.mse * 10 ** (st.sqnr_db / 10) if st.sqnr_db is not None else 0.0) * st.numel
        cos += st.cosine * st.numel
        bpw += st.bits_per_weight * st.numel
    if not n:
        return {"sqnr_db": None, "mse": None, "cosine": None, "bits_per_weight": None}
    return {"sqnr_db": 10 * math.log10(sig / err) if err > 0 and sig > 0 else None, "mse": err / n,
            "cosine": cos / n, "bits_per_weight": bpw / n}


def format_analysis(resp: AnalyzeResponse) -> str:
    if not resp.tensors:
        return "no tensors to analyze"
    schemes = [r.scheme for r in resp.tensors[0].results]
    labels = [scheme_label(s) for s in schemes]
    blocks = []
    for metric, title in (("sqnr_db", "SQNR dB"), ("mse", "MSE"), ("cosine", "cosine"),
                          ("bits_per_weight", "bits/weight")):
        shown = _cosine if metric == "cosine" else (lambda v: v)
        rows = [[t.name, *[shown(getattr(r.stats, metric)) for r in t.results]] for t in resp.tensors]
        rows.append(["(overall)", *[shown(overall(resp, k)[metric]) for k in range(len(schemes))]])
        blocks.append(title + "\n" + table(["tensor", *labels], rows))
    for t in resp.tensors:
        a = t.analyses
        if a is None:
            continue
        if a.bit_widths:
            blocks.append(f"{t.name}: bit widths\n" + table(
                ["dtype", "SQNR dB", "theory dB", "MSE", "bits/weight"],
                [[b.dtype, b.sqnr_db, b.theoretical_sqnr_db, b.stats.mse, b.stats.bits_per_weight]
                 for b in a.bit_widths]))
        if a.outlier_impact:
            blocks.append(f"{t.name}: outlier impact (range clipped at a percentile)\n" + table(
                ["percentile", "MSE", "SQNR dB", "clipped", "MSE outliers", "MSE inliers"],
                [[o.percentile, o.mse, o.sqnr_db, o.clipped_fraction, o.mse_outliers, o.mse_inliers]
                 for o in a.outlier_impact]))
        if a.scale_sensitivity:
            blocks.append(f"{t.name}: scale sensitivity\n" + table(
                ["perturbation", "MSE", "MSE change"],
                [[x.perturbation, x.mse, x.relative_mse_change] for x in a.scale_sensitivity]))
    return "\n\n".join(blocks)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# -- config and clients ---------------------------------------------------------------------------

def build_config(args: argparse.Namespace) -> QuantConfig:
    """The ``--config`` file's QuantConfig with the scheme flags on top, merged as a rule's scheme is (a new
    ``--dtype`` brings its own symmetric default, ``--group-size`` asks for groups)."""
    import pydantic

    from quantd_client._schemas import SchemeOverride

    data: dict[str, Any] = {}
    if args.config:
        try:
            data = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--config {args.config}: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("scheme", {}), dict):
            raise UsageError(f"--config {args.config}: a QuantConfig is a JSON object whose \"scheme\" is an object, "
                             f'e.g. {{"scheme": {{"dtype": "int4", "group_size": 128}}}}')
    skips = getattr(args, "skip", None) or []
    rules = data.get("rules", [])
    if skips and isinstance(rules, list):  # ahead of the file's rules: the first match wins
        data = {**data, "rules": [{"match": g, "skip": True} for g in skips] + rules}
    if getattr(args, "quantize_embeddings", False):
        data = {**data, "skip_embeddings": False}
    flags = {key: getattr(args, key) for key in ("dtype", "group_size", "granularity", "observer", "symmetric",
                                                  "method") if getattr(args, key, None) is not None}
    if getattr(args, "method_arg", None):
        flags["method_args"] = _method_args(args.method_arg)
    if getattr(args, "format", None) is not None:
        data = {**data, "output": args.format}
    if getattr(args, "gguf_mix", None) is not None:  # a llama.cpp mix implies GGUF output
        data = {**data, "gguf_mix": args.gguf_mix, "output": data.get("output", "gguf")}
    calibration = {k: v for k, v in (("samples", getattr(args, "calibration_samples", None)),
                                     ("max_seq_len", getattr(args, "calibration_max_seq_len", None))) if v is not None}
    if calibration:  # model-aware calibration's bounds, over the config file's
        data = {**data, "calibration": {**(data.get("calibration") or {}), **calibration}}
    try:
        config = QuantConfig.model_validate(data)
        if flags:
            scheme = config.override_scheme(SchemeOverride.model_validate(flags))
            config = QuantConfig.model_validate({**data, "scheme": scheme.model_dump(exclude_unset=True)})
        return config
    except pydantic.ValidationError as e:
        raise UsageError("config: " + "; ".join(_validation_message(x) for x in e.errors())) from None


def _validation_message(error: Any) -> str:
    """One pydantic error as ``where: what``: a model-level check has no location, and its message loses
    pydantic's "Value error, " prefix (the text says what is wrong, and where, itself)."""
    msg = str(error["msg"]).removeprefix("Value error, ")
    where = ".".join(map(str, error["loc"]))
    if hint := _FLAG_HINTS.get(msg.split(":", 1)[0]):
        msg = f"{msg} ({hint})"
    return f"{where}: {msg}" if where else msg


# What a command-line user does about a config-level refusal (the message's field before its colon).
_FLAG_HINTS = {"scheme.dtype": "add --format gguf for a GGUF input", "gguf_mix": "--gguf-mix writes GGUF: "
               "leave --format out, or give --format gguf"}


def _arg_default(arg: MethodArg) -> str:
    """A method argument's default as its type reads: ``iters=2``, not the wire's ``2.0``."""
    if arg.type == "int" and not isinstance(arg.default, bool):
        return str(int(arg.default))
    return str(arg.default).lower() if isinstance(arg.default, bool) else str(arg.default)


def _method_args(pairs: Sequence[str]) -> dict[str, float | bool]:
    """``--method-arg KEY=VALUE`` pairs: true/false, else a finite number (an integer stays one)."""
    out: dict[str, float | bool] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--method-arg {pair!r}: expected KEY=VALUE, e.g. act_order=true or damp=0.01")
        low = raw.strip().lower()
        if low in ("true", "false"):
            out[key] = low == "true"
            continue
        try:
            number = float(raw)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise UsageError(f"--method-arg {pair!r}: the value must be true, false or a finite number") from None
        out[key] = int(raw) if raw.strip().lstrip("+-").isdigit() else number
    return out


def build_schemes(args: argparse.Namespace) -> list[Scheme]:
    import pydantic

    out = []
    for dtype in args.dtype or DEFAULT_ANALYZE_DTYPES:
        data: dict[str, Any] = {"dtype": dtype}
        for key in ("group_size", "granularity", "observer", "symmetric", "method"):
            if getattr(args, key, None) is not None:
                data[key] = getattr(args, key)
        if getattr(args, "method_arg", None):
            data["method_args"] = _method_args(args.method_arg)
        try:
            out.append(Scheme.model_validate(data))
        except pydantic.ValidationError as e:
            raise UsageError(f"scheme {dtype}: " + "; ".join(x["msg"] for x in e.errors())) from None
    return out


def make_client(args: argparse.Namespace) -> Any:
    from quantd_client._client import Client

    url = args.server or os.environ.get("QUANTD_URL") or "http://127.0.0.1:8000"
    if not url.startswith(("http://", "https://")):
        where = "--server" if args.server else "QUANTD_URL"
        raise UsageError(f"{where} {url!r} is not an http:// or https:// URL (such as http://127.0.0.1:8000)")
    return Client(url, api_key=args.api_key, timeout=args.timeout)


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when there is a GPU, else ``cpu``; a CUDA device that is not there is a usage error
    (one line, not a traceback from deep in torch)."""
    if device == "cpu":  # nothing to check: no CUDA probe, no job layer imported
        return device
    from quantd.errors import ConfigError
    from quantd.jobs.config import check_device

    try:
        available = check_device(device)
    except ConfigError as e:
        raise UsageError(e.detail) from None  # "field 'device': cuda:1 requested but 0 CUDA device(s) available"
    if device == "auto":
        return "cuda" if available else "cpu"
    return device


# -- commands ------------------------------------------------------------------------------------

def _settings(args: argparse.Namespace, **extra: Any) -> Any:
    import pydantic

    from quantd.server.settings import Settings

    given = {k: getattr(args, k) for k in ("host", "port", "data_dir", "workers", "device")
             if getattr(args, k, None) is not None}
    try:
        return Settings(**given, **extra)
    except pydantic.ValidationError as e:  # one line per field, and never the value (it may be a key)
        def line(err: Any) -> str:
            msg = str(err["msg"]).removeprefix("Value error, ")
            if not err["loc"]:
                return msg
            field = str(err["loc"][0])  # a flag given on the command line, else its environment variable
            return f"--{field.replace('_', '-')}: {msg}" if field in given else f"QUANTD_{field.upper()}: {msg}"

        raise UsageError("settings: " + "; ".join(map(line, e.errors(include_input=False, include_url=False)))) from None
    except ValueError as e:
        raise UsageError(f"settings: {e}") from None


def _chunk_work_only(schemes: Sequence[Scheme | SchemeOverride], *, output: str = "safetensors",
                     calibration: object = None) -> bool:
    """Whether a one-shot run's work is the engine's eager chunk loops: round to nearest, no calibration, no
    ggml block types (engine/ggml sizes its own chunk pool by the calling thread's thread count). The
    methods and calibration multiply large matrices, where OpenMP's threads pay off."""
    from quantd_client import DTYPES

    return (calibration is None and output != "gguf"
            and all((s.method or "rtn") == "rtn" and (s.dtype is None or DTYPES[s.dtype].kind != "ggml")
                    for s in schemes))


def _prepare_in_process(model: Path, *, chunk_work_only: bool = True, config: QuantConfig | None = None) -> None:
    """Before the CLI's in-process engine runs (and imports torch): glibc's malloc as
    ``QUANTD_KEEP_FREED_MEMORY`` says, Inductor's kernel cache per kind of CPU in its default dir,
    whether compiled kernels can pay off in this one run over ``model`` (quantizing with ``config``), and the
    threads of an eager run whose work is the chunk loops (:func:`_chunk_work_only`): its main thread's own
    ops single-threaded."""
    from quantd.runtime import keep_freed_memory_as_configured, keep_kernel_cache_in, use_kernels_for

    try:
        keep_freed_memory_as_configured()
    except ValueError as e:
        raise UsageError(f"settings: {e}") from None
    keep_kernel_cache_in(None)
    if not use_kernels_for(model, config) and chunk_work_only:  # parallel over chunks, no OpenMP join per op
        from quantd.engine.parallel import single_threaded_caller

        single_threaded_caller()


def cmd_serve(args: argparse.Namespace) -> int:
    from quantd.runtime import keep_freed_memory
    from quantd.server.main import run_server

    settings = _settings(args)
    keep_freed_memory(settings.keep_freed_memory)  # before torch (resolve_device) starts any thread
    if settings.device.startswith("cuda"):  # workers' and sync endpoints' device: refused here, not in a
        resolve_device(settings.device)  # traceback (auto and cpu need no check, nor torch imported yet)
    run_server(settings)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from quantd.runtime import keep_freed_memory, run_worker

    settings = _settings(args)
    keep_freed_memory(settings.keep_freed_memory)  # before torch starts any thread
    run_worker(settings)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Apply the database migrations this quantd needs (QUANTD_DATABASE_URL; SQLite by default)."""
    from quantd.jobs.backends import upgrade_database
    from quantd.server.app import jobs_config

    shown, applied = upgrade_database(jobs_config(_settings(args), workers=0))
    print(f"{shown}: " + (f"applied migration(s) {applied}" if applied else "schema up to date"))
    return 0


def _parent_made(output: str | Path) -> Path:
    """``-o FILE`` with its folder created, as the directory outputs are."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _check_output(args: argparse.Namespace, config: QuantConfig) -> None:
    """Before any work, in-process and with ``--server`` alike: a directory output (a model directory, or a
    format that writes one) goes to an absent or empty directory, never mixed with files already there; a
    file output is not an existing directory (an existing file is replaced)."""
    out = Path(args.output)
    if out.is_symlink() and not out.exists():
        raise FileNotFoundError(f"-o {out}: a symbolic link to nothing")
    if Path(args.input).is_dir() or config.output in DIRECTORY_OUTPUT_FORMATS:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"-o {out}: exists and is not an empty directory (the output is a model "
                                  "directory: give a new or empty one)")
    elif out.is_dir():
        raise IsADirectoryError(f"-o {out} is a directory: give the output file's path")


def cmd_quantize(args: argparse.Namespace) -> int:
    config = build_config(args)
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise UsageError(f"-o {args.output} is the input file: it would be overwritten")
    _check_output(args, config)
    if args.server:  # as a job: no sync size limit, and the same Report as in-process
        progress = False if args.json else None  # bars on a TTY only
        with make_client(args) as c:
            job = c.submit(args.input, config, calibration=args.calibration, progress=progress)
            # On stderr, so that --json stays one document: the id to follow or fetch the job by if this
            # command is interrupted (quantd jobs show|download ID).
            print(f"quantd quantize: job {job.id} submitted to {c.base_url}", file=sys.stderr)
            try:
                job = job.wait(timeout=args.wait_timeout, progress=progress)
            except KeyboardInterrupt:  # the job lives on: say how to find it or stop it
                print(f"\nquantd quantize: interrupted; job {job.id} goes on at {c.base_url} (quantd jobs show|"
                      f"download {job.id}; quantd jobs cancel {job.id} stops it)", file=sys.stderr)
                raise
            if job.status != "succeeded":
                why = f": {job.error.title}: {job.error.detail}" if job.error is not None else ""
                raise JobFailed(f"job {job.id} {job.status}{why}")
            job.download(_parent_made(args.output), progress=progress)
            report = job.report()
    else:
        schemes = [config.scheme, *(r.scheme for r in config.rules if r.scheme is not None)]
        _prepare_in_process(Path(args.input), chunk_work_only=_chunk_work_only(
            schemes, output=config.output, calibration=args.calibration), config=config)
        report = _quantize_in_process(args, config)
    if args.json:
        _print_json(report.model_dump(mode="json"))
    else:
        print(format_report(report))
    return 0


def _quantize_in_process(args: argparse.Namespace, config: QuantConfig) -> Report:
    """A model directory (or a file whose output format writes a directory) into the directory ``-o``;
    otherwise one file into the artifact file ``-o``."""
    from quantd.io.outputs import get_format

    device = resolve_device(args.device)
    if Path(args.input).is_dir() or get_format(config.output).writes_config:
        from quantd.io.formats import detect_format
        from quantd.io.model_dir import ModelFiles, quantize_directory

        if Path(args.input).is_dir():
            files: Path | ModelFiles = Path(args.input)
        else:  # one weight file, named as transformers looks for it
            name = "pytorch_model.bin" if detect_format(args.input) == "pytorch" else "model.safetensors"
            files = ModelFiles({name: Path(args.input)})
        return quantize_directory(files, args.output, config, device=device, calibration=args.calibration)
    from quantd.io.pipeline import quantize_file

    return quantize_file(args.input, _parent_made(args.output), config, device=device, calibration=args.calibration)


def cmd_warm_up(args: argparse.Namespace) -> int:
    """Build the GGUF kernels into the kernel cache of the CLI's one-shot runs (or of ``--data-dir``'s
    serve/worker), and mark it filled: one-shot GGUF runs then take the compiled kernels from
    ``WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD`` ggml weights a thread rather than a billion."""
    from quantd.runtime import keep_freed_memory_as_configured, keep_kernel_cache_in, mark_gguf_kernels_cached

    try:
        keep_freed_memory_as_configured()
    except ValueError as e:
        raise UsageError(f"settings: {e}") from None
    keep_kernel_cache_in(Path(args.data_dir) if args.data_dir else None)
    from quantd.engine.ggml._common import take_kernels
    from quantd.engine.kernels import KERNELS
    from quantd.io.outputs.gguf import warm_up_gguf

    if not KERNELS.available():
        raise UsageError("the compiled kernels are off here (QUANTD_COMPILE=0, or no C++ compiler for torch.compile)")
    take_kernels()
    took = warm_up_gguf()
    if took is None:
        raise UsageError("the compiled kernels are off here")
    mark_gguf_kernels_cached(strict=True)
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if args.json:
        _print_json({"seconds": round(took, 1), "kernel_cache": cache})
    else:
        print(f"GGUF kernels ready in {took:.1f} s (kernel cache: {cache})")
    return 0


def cmd_dequantize(args: argparse.Namespace) -> int:
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise UsageError(f"-o {args.output} is the input file: it would be overwritten")
    from quantd.io.artifact import write_dense

    layout = write_dense(args.input, _parent_made(args.output))
    size = Path(args.output).stat().st_size
    if args.json:
        _print_json({"path": str(args.output), "bytes": size, "tensors": len(layout)})
    else:
        print(f"saved {args.output}: {len(layout)} tensors, {size} bytes")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    schemes = build_schemes(args)
    if args.server:
        with make_client(args) as c:
            resp = c.analyze(args.input, schemes, analyses=args.analyses)
    else:
        _prepare_in_process(Path(args.input), chunk_work_only=_chunk_work_only(schemes))
        from quantd.io.pipeline import analyze_file

        resp = analyze_file(args.input, schemes, device=resolve_device(args.device), analyses=args.analyses)
    if args.json:
        _print_json({**resp.model_dump(mode="json"),
                     "overall": [overall(resp, k) for k in range(len(schemes))]})
    else:
        print(format_analysis(resp))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with make_client(args) as c:
        if args.jobs_cmd == "list":
            jobs = [j.model for j in c.list_jobs(status=args.status, limit=args.limit)]
            if args.json:
                _print_json([j.model_dump(mode="json") for j in jobs])
            else:
                print(table(["id", "status", "created", "progress", "input"],
                            [[j.id, j.status, j.created_at.isoformat(timespec="seconds"),
                              f"{j.progress.fraction:.0%}", j.input.filename] for j in jobs]))
        elif args.jobs_cmd == "show":
            _print_json(c.get_job(args.id).model.model_dump(mode="json"))
        elif args.jobs_cmd == "cancel":
            job = c.cancel(args.id)
            status = job.status if job else "cancelled"
            note = (" (it had finished: its artifact and report are deleted)"
                    if job is not None and status == "succeeded" and job.model.expired_at is not None else "")
            print(json.dumps(job.model.model_dump(mode="json")) if job and args.json else f"{args.id}: {status}{note}")
        else:
            job = c.get_job(args.id)
            path = job.download(args.output, progress=False if args.json else None)
            print(json.dumps({"id": job.id, "path": str(path)}) if args.json else f"saved {path}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with make_client(args) as c:
        info = c.info()
    if args.json:
        _print_json(info.model_dump(mode="json"))
    else:
        devices = ", ".join(f"{d.name} ({d.type})" for d in info.devices) or "-"
        print(table(["field", "value"], [
            ["version", info.version], ["devices", devices], ["dtypes", " ".join(info.dtypes)],
            ["observers", " ".join(info.observers)],
            *[[f"method {m.name}", " ".join(f"{a.name}={_arg_default(a)}" for a in m.args) or "-"]
              for m in info.method_args],
            ["granularities", " ".join(info.granularities)],
            ["input formats", " ".join(info.input_formats)], ["output formats", " ".join(info.output_formats)],
            ["gguf mixes", " ".join(info.gguf_mixes) or "-"],
            ["max upload bytes", info.limits.max_upload_bytes], ["max sync bytes", info.limits.max_sync_bytes],
            ["auth", info.auth]]))
    return 0


# -- parser --------------------------------------------------------------------------------------

DEVICE_HELP = "auto|cpu|cuda|cuda:N (default: QUANTD_DEVICE, else auto)"


def _scheme_flags(p: argparse.ArgumentParser, *, many_dtypes: bool) -> None:
    if many_dtypes:
        p.add_argument("--dtype", action="append", help="a scheme's dtype; repeat to compare (default int8, int4)")
    else:
        p.add_argument("--dtype", help="|".join(get_args(DType)))
    p.add_argument("--group-size", type=int, help="elements sharing one scale (granularity group)")
    p.add_argument("--granularity", choices=get_args(GranularityName))
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false")
    p.add_argument("--observer", choices=get_args(ObserverName))
    p.add_argument("--method", choices=list(get_args(MethodName)),
                   help="rtn (default) | hqq (gptq and awq need calibration, which only quantize takes)"
                   if many_dtypes else "rtn (default) | hqq | gptq, awq (these two need --calibration)")
    p.add_argument("--method-arg", action="append", metavar="KEY=VALUE",
                   help="an argument of the method, e.g. act_order=true; repeatable (quantd info lists them)")


# The largest count or seconds a flag takes (a year of seconds: larger ones overflow the socket's timeout).
_LARGEST = 365 * 24 * 3600


def _positive(kind: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type: ``kind`` of the text, above 0 (a usage error, exit 2, otherwise)."""
    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < value <= _LARGEST:  # type: ignore[operator]  (NaN fails too)
            raise argparse.ArgumentTypeError(f"must be above 0 and at most {_LARGEST:g}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--server", help="server URL (jobs/info default: QUANTD_URL, else http://127.0.0.1:8000)")
    client.add_argument("--api-key", help="bearer key (default: QUANTD_API_KEY)")
    client.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds per request (default 300)")
    client.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(prog="quantd", description="Quantization service for ML weights.")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, help_ in (("serve", "run the API (with embedded workers)"), ("worker", "run workers only")):
        p = sub.add_parser(name, help=help_)
        if name == "serve":
            p.add_argument("--host", help="bind address (default: QUANTD_HOST, else 127.0.0.1)")
            p.add_argument("--port", type=int, help="port (default: QUANTD_PORT, else 8000)")
        p.add_argument("--data-dir", help="jobs database and files (default: QUANTD_DATA_DIR, else ./quantd-data)")
        p.add_argument("--workers", type=int, help="worker count (default: QUANTD_WORKERS, else one per CUDA "
                                                   "device, or one on the CPU without CUDA; "
                                                   + ("0: the API alone, no embedded workers)" if name == "serve"
                                                      else "0 means that default too)"))
        p.add_argument("--device", help=DEVICE_HELP)
        p.set_defaults(func=cmd_serve if name == "serve" else cmd_worker)

    p = sub.add_parser("db", help="the job database")
    db = p.add_subparsers(dest="db_command", required=True)
    q = db.add_parser("upgrade", help="apply pending schema migrations (QUANTD_DATABASE_URL)")
    q.add_argument("--data-dir", help="the data dir of the default SQLite database (default: QUANTD_DATA_DIR)")
    q.set_defaults(func=cmd_db_upgrade)

    p = sub.add_parser("quantize", parents=[client],
                       help="quantize a file or a model directory, in-process or through --server")
    p.add_argument("input", type=Path, help="a weight file, or a model directory (config.json, shards, index, ...)")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="the artifact file; a directory for a model directory or a format that writes one")
    p.add_argument("--config", help="a QuantConfig JSON file; flags override its scheme")
    p.add_argument("--format", choices=OUTPUT_FORMATS,
                   help="output format (the config's \"output\"; default: the config's, else safetensors)")
    p.add_argument("--wait-timeout", type=_positive(float), default=None,
                   help="with --server: seconds to wait for the job (default: no limit); the job id is on stderr")
    p.add_argument("--gguf-mix", choices=GGUF_MIXES,
                   help="a llama.cpp mix (llama-quantize's type, e.g. Q4_K_M) for a GGUF input; implies --format gguf")
    p.add_argument("--calibration", type=Path,
                   help="calibration file: activation samples; for gptq/awq each Linear M's input rows M [N, in] "
                        "or M.hessian + M.hessian_count (quantd_client.calibration.CalibrationRecorder writes "
                        "it); for GGUF output llama.cpp's importance matrix; with a model directory also JSONL "
                        "lines {\"text\": ...} or {\"input_ids\": [...]} that the model is run on, block by block")
    p.add_argument("--calibration-samples", type=int, metavar="N",
                   help="JSONL calibration: lines used (config.calibration.samples, default 128)")
    p.add_argument("--calibration-max-seq-len", type=int, metavar="L",
                   help="JSONL calibration: tokens per line at most (config.calibration.max_seq_len, default 512)")
    _scheme_flags(p, many_dtypes=False)
    p.add_argument("--skip", action="append", default=[], metavar="GLOB",
                   help="leave tensors whose name matches GLOB as they are (repeatable; before the config's rules)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="quantize embedding tables and output heads too (skip_embeddings=false)")
    p.add_argument("--device", default=os.environ.get("QUANTD_DEVICE", "auto"), help=DEVICE_HELP)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("warm-up", help="build the GGUF kernels into this machine's kernel cache (minutes once); "
                                       "one-shot GGUF runs then take them from 0.15 billion weights a thread")
    p.add_argument("--data-dir", help="fill the kernel cache of serve/worker with this data dir (default: the "
                                      "cache of the CLI's one-shot runs)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_warm_up)

    p = sub.add_parser("dequantize", help="an artifact back to a plain safetensors file (original names and dtypes)")
    p.add_argument("input", type=Path, help="a quantd artifact (.safetensors)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_dequantize)

    p = sub.add_parser("analyze", parents=[client], help="error statistics of several schemes side by side")
    p.add_argument("input", type=Path)
    _scheme_flags(p, many_dtypes=True)
    p.add_argument("--analysis", action="append", default=[], dest="analyses",
                   choices=get_args(AnalysisName),
                   help="also run this analysis on the first scheme (repeatable)")
    p.add_argument("--device", default=os.environ.get("QUANTD_DEVICE", "auto"), help=DEVICE_HELP)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("jobs", help="list, show, cancel and download jobs")
    jobs = p.add_subparsers(dest="jobs_cmd", required=True)
    q = jobs.add_parser("list", parents=[client], help="this tenant's jobs, newest first")
    q.add_argument("--status", choices=get_args(JobStatus), help="only the jobs in this state")
    q.add_argument("--limit", type=_positive(int), default=50, help="at most this many jobs (default: %(default)s)")
    helps = {"show": "the job as JSON", "download": "the artifact (sha256-checked, resumable)",
             "cancel": "cancel a queued or running job and delete its files (a finished job: its artifact and "
                       "report are deleted, the job stays)"}
    for name in ("show", "cancel", "download"):
        q = jobs.add_parser(name, parents=[client], help=helps[name])
        q.add_argument("id")
        if name == "download":
            q.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("info", parents=[client], help="the server's version, devices and limits")
    p.set_defaults(func=cmd_info)
    return parser


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file descriptor (captured output)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from quantd_client._exceptions import QuantdError as ClientError

    args = build_parser().parse_args(argv)
    from quantd.runtime import compile_setting_error  # torch-free

    engine_runs = args.command in ("serve", "worker", "warm-up") or (
        args.command in ("quantize", "analyze") and not getattr(args, "server", None))
    if engine_runs and (bad := compile_setting_error()) is not None:
        print(f"quantd {args.command}: settings: {bad}", file=sys.stderr)
        return 2
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not as a warning at interpreter exit
        return rc
    except BrokenPipeError:  # `quantd ... | head`: the reader has gone; end quietly, as a SIGPIPE'd tool does
        _discard_stdout()
        return 128 + 13
    except UsageError as e:
        print(f"quantd {args.command}: {e}", file=sys.stderr)
        return 2
    except ClientError as e:
        print(f"quantd {args.command}: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # missing files, and the in-process domain errors below
        print(f"quantd {args.command}: {e}", file=sys.stderr)
        return 1
    except JobFailed as e:
        print(f"quantd {args.command}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # the SDK-only install: no torch or server packages
        if e.name is None or e.name.split(".")[0] not in SERVER_PACKAGES:
            raise
        hint = ", or pass --server URL" if args.command in ("quantize", "analyze") else ""
        print(f"quantd {args.command}: {e}; this needs the server extra (pip install 'quantd[server]'){hint}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from quantd.errors import QuantdError as DomainError

        if isinstance(e, DomainError):
            print(f"quantd {args.command}: {e.detail}", file=sys.stderr)
            return 1
        raise


def run() -> NoReturn:
    """The ``quantd`` program (``python -m quantd`` and the installed script): :func:`main`, then the exit.

    Once torch is imported, the interpreter's teardown (freeing its modules, then libtorch's static
    destructors) takes a few tenths of a second: as long as a one-shot run's own work on a small model. It has
    nothing left to do: every output file is closed by then. So the process ends the way the interpreter
    would up to that teardown — non-daemon threads joined, ``atexit`` callbacks run (logging's flush among
    them), stdout and stderr flushed — and then exits at once. An exception that escapes :func:`main` takes
    the normal path, with its traceback.
    """
    code = main()
    if "torch" in sys.modules:
        import atexit
        import threading

        shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first: joins the threads
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()  # the interpreter's own exit hooks, in its order
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
                code = code or 1
        os._exit(code)
    raise SystemExit(code)
