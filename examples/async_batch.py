"""Submit several files at once with the async client and wait for all of them.

    python examples/async_batch.py a.safetensors b.npz ... [--server URL]   # default: $QUANTD_URL, else :8000
"""

import argparse
import asyncio
from pathlib import Path

from quantd_client import AsyncClient


async def one(client: AsyncClient, src: Path) -> str:
    job = await client.submit(src, {"scheme": {"dtype": "int4", "group_size": 32}}, progress=False)
    job = await job.wait(progress=False)
    if job.status != "succeeded":
        return f"{src.name}: {job.status} {job.error.detail if job.error else ''}"
    dst = await job.download(src.with_suffix(".quantd.safetensors"), progress=False)
    s = (await job.report()).summary
    return f"{src.name}: {s.tensors_quantized} tensors, mean SQNR {s.mean_sqnr_db or float('inf'):.2f} dB -> {dst}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--server", default=None, help="default: $QUANTD_URL, else http://127.0.0.1:8000")
    args = ap.parse_args()
    async with AsyncClient(args.server) as client:
        for line in await asyncio.gather(*(one(client, f) for f in args.files)):
            print(line)


if __name__ == "__main__":
    asyncio.run(main())
