"""The streaming NaN/Inf scan of safetensors uploads: the same answer as reading the tensors, however the
bytes are cut into chunks; None when it cannot follow the file."""

from __future__ import annotations

import random

import torch
from safetensors.torch import save

from quantd.io.finite_scan import FiniteScan


def _scan(raw: bytes, rng: random.Random) -> list[str] | None:
    scan, pos = FiniteScan(), 0
    while pos < len(raw):
        step = rng.choice([1, 2, 3, 7, 64, 4096])
        scan.feed(memoryview(raw)[pos:pos + step])
        pos += step
    return scan.non_finite()


def test_the_scan_finds_exactly_the_non_finite_float_tensors_for_any_chunking() -> None:
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8]
    for _ in range(200):
        tensors = {}
        for i in range(rng.randint(1, 6)):
            dt, n = rng.choice(dtypes), rng.randint(0, 40)
            t = torch.randn(n).to(dt) if dt.is_floating_point else torch.randint(0, 100, (n,), dtype=dt)
            if n and dt.is_floating_point and rng.random() < 0.4:
                t[rng.randrange(n)] = rng.choice([float("nan"), float("inf"), float("-inf")])
            tensors[f"t{i}"] = t
        expect = [k for k, v in tensors.items() if v.dtype.is_floating_point and not torch.isfinite(v).all()]
        got = _scan(save(tensors), rng)
        assert got is not None and sorted(got) == sorted(expect)


def test_what_the_scan_cannot_follow_is_none() -> None:
    rng = random.Random(1)
    raw = save({"w": torch.ones(8)})
    assert _scan(b"PK\x03\x04 not safetensors at all", rng) is None
    assert _scan(raw[:-4], rng) is None  # cut short: the last tensor not wholly seen
    assert _scan((2**40).to_bytes(8, "little") + b"{}", rng) is None  # a header length past any limit
    assert _scan(raw, rng) == []


def test_a_header_the_reader_refuses_ends_the_scan_quietly_and_cheaply() -> None:
    """An Infinity offset raised OverflowError out of the upload (a 500); a header of millions of tiny
    entries was parsed in full for the scan although the reader refuses it unparsed."""
    import struct
    import time

    from quantd.io.st_header import MAX_STRUCTURE

    rng = random.Random(2)
    head = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,Infinity]}}'
    assert _scan(struct.pack("<Q", len(head)) + head + bytes(8), rng) is None
    body = b"{" + b",".join(b'"%d":[]' % i for i in range(MAX_STRUCTURE // 3 + 10)) + b"}"
    assert _scan(struct.pack("<Q", len(body)) + body, rng) is None
    many = save({f"t{i}": torch.tensor([float("nan")]) for i in range(20_000)})  # every tensor bad
    t0 = time.perf_counter()
    scan = FiniteScan()
    scan.feed(many)
    assert len(scan.non_finite() or []) == 20_000 and time.perf_counter() - t0 < 5
