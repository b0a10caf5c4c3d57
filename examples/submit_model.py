"""Submit a model file as a job, follow it, download the artifact and print the report.

    python examples/submit_model.py model.safetensors [URL]    # default: $QUANTD_URL, else http://127.0.0.1:8000
"""

import sys
from pathlib import Path

from quantd_client import Client

src = Path(sys.argv[1])
url = sys.argv[2] if len(sys.argv) > 2 else None  # None: the client reads QUANTD_URL
config = {
    "scheme": {"dtype": "int4", "group_size": 128},
    "rules": [{"match": "lm_head.*", "scheme": {"dtype": "int8", "granularity": "channel"}}],
}

with Client(url) as client:  # QUANTD_API_KEY is read from the environment
    job = client.submit(src, config)          # streamed from disk; a progress bar on a TTY
    job = job.wait(progress=True)             # follows /events, falls back to polling
    if job.status != "succeeded":
        sys.exit(f"job {job.id} {job.status}: {job.error.detail if job.error else ''}")
    dst = job.download(src.with_suffix(".quantd.safetensors"))   # resumable, sha256-checked
    report = job.report()

for t in report.tensors:
    if t.stats:
        print(f"{t.name:40s} {t.scheme.dtype if t.scheme else '':6s} SQNR {t.stats.sqnr_db or float('inf'):6.2f} dB")
    else:
        print(f"{t.name:40s} kept ({t.reason})")
print(f"saved {dst}: {report.summary.compression_ratio:.2f}x smaller, "
      f"{report.summary.bits_per_weight:.2f} bits/weight")
