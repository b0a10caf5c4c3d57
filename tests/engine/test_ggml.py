"""ggml block types: the legacy ones byte for byte against gguf-py's NumPy port of ggml's reference
quantizers, the k-quants decodable by gguf-py and no worse than llama.cpp's own quantizer."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from _gguf_models import ggml_library, ggml_quantize
from quantd.engine import ggml
from quantd.errors import ConfigError

LEGACY = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def _data(kind: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(-1, 1, shape).astype(np.float32)
    if kind == "gaussian":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "heavy":  # Student t with 2 degrees of freedom: a few huge values per block
        return rng.standard_t(2, shape).astype(np.float32)
    if kind == "zero":
        return np.zeros(shape, np.float32)
    if kind == "ties":  # many equal magnitudes (max ties of either sign) and exact half-steps
        return (rng.integers(-8, 9, shape) * 0.125).astype(np.float32)
    raise AssertionError(kind)


KINDS = ["uniform", "gaussian", "heavy", "zero", "ties"]


def _record_compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """With QUANTD_COMPILE=1 (the k-quant searches and legacy quantizers compile only when asked to), the
    names of the compiled calls that returned a result."""
    from quantd.engine import kernels

    monkeypatch.setenv("QUANTD_COMPILE", "1")
    call = kernels.KERNELS.call
    ran: list[str] = []

    def recorded(kernel: str, *args: Any, **kwargs: Any) -> Any:
        out = call(kernel, *args, **kwargs)
        if out is not None:
            ran.append(kernel)
        return out

    monkeypatch.setattr(kernels.KERNELS, "call", recorded)
    return ran


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LEGACY)
def test_legacy_types_are_byte_identical_to_ggml_reference(name: str, kind: str, dtype: torch.dtype, path: str,
                                                           request: pytest.FixtureRequest) -> None:
    """Through the eager ops and through the one fused compiled pass alike."""
    request.getfixturevalue(path)
    ran = _record_compiled_calls(request.getfixturevalue("monkeypatch")) if path == "compiled" else []
    x = torch.from_numpy(_data(kind, (48, 256))).to(dtype)
    t = ggml.GGML_TYPES[name]
    ours = ggml.quantize(x, t).data.numpy()
    ref = gguf.quants.quantize(x.float().numpy(), GGMLQuantizationType(t.type_id))
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref)
    assert ran == ([f"ggml_quantize_{name}"] if path == "compiled" else [])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_gguf_py_decodes_our_bytes_as_our_decoder_does(name: str, kind: str) -> None:
    x = _data(kind, (16, 512), seed=1)
    t = ggml.GGML_TYPES[name]
    q = ggml.quantize(torch.from_numpy(x), t)
    theirs = gguf.quants.dequantize(q.data.numpy(), GGMLQuantizationType(t.type_id))
    ours = ggml.dequantize(q).numpy()
    assert theirs.shape == x.shape
    assert np.array_equal(theirs, ours)
    if kind == "zero":
        assert not ours.any()
    else:  # a quantizer, not noise: the error is a small part of the signal
        assert ((ours - x) ** 2).mean() < 0.1 * (x ** 2).mean()


def test_ggml_decoder_matches_ggml_on_its_own_bytes() -> None:
    if ggml_library() is None:
        pytest.skip("llama-cpp-python (ggml's library) is not installed: gguf-py's decoder is the reference instead")
    x = _data("gaussian", (8, 512), seed=2)
    for name in LEGACY + KQUANTS:
        t = ggml.GGML_TYPES[name]
        raw = ggml_quantize(x, t.type_id, t.row_bytes(512))
        mine = ggml.dequantize(ggml.GGMLQuantized(t, x.shape, torch.from_numpy(raw))).numpy()
        assert np.array_equal(mine, gguf.quants.dequantize(raw, GGMLQuantizationType(t.type_id))), name


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("kind", ["gaussian", "heavy", "uniform"])
@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_error_is_no_worse_than_llama_cpp(name: str, kind: str, path: str, request: pytest.FixtureRequest
                                                 ) -> None:
    """The whole tensor's mse (and, with an importance matrix, its importance-weighted mse) at most
    llama.cpp's on the same tensor, through the eager ops and through the compiled search kernels."""
    request.getfixturevalue(path)
    ran = _record_compiled_calls(request.getfixturevalue("monkeypatch")) if path == "compiled" else []
    if ggml_library() is None:
        pytest.skip("llama-cpp-python (ggml's library) is not installed: no llama.cpp quantizer to compare with")
    x = _data(kind, (64, 1024), seed=3)
    t = ggml.GGML_TYPES[name]
    ref = ggml.dequantize(ggml.GGMLQuantized(t, x.shape, torch.from_numpy(
        ggml_quantize(x, t.type_id, t.row_bytes(1024))))).numpy()
    ours = ggml.dequantize(ggml.quantize(torch.from_numpy(x), t)).numpy()
    assert ((ours - x) ** 2).mean() <= ((ref - x) ** 2).mean()
    imp = (np.random.default_rng(4).random(1024) ** 3 * 5 + 1e-3).astype(np.float32)
    ref = ggml.dequantize(ggml.GGMLQuantized(t, x.shape, torch.from_numpy(
        ggml_quantize(x, t.type_id, t.row_bytes(1024), imp)))).numpy()
    ours = ggml.dequantize(ggml.quantize(torch.from_numpy(x), t, importance=torch.from_numpy(imp))).numpy()
    assert (imp * (ours - x) ** 2).mean() <= (imp * (ref - x) ** 2).mean()
    if path == "compiled":  # the searches and settles ran compiled, not eager
        assert any("search" in k for k in ran) and any("settle" in k for k in ran), ran


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_types_are_the_reference_bytes_with_an_importance_matrix_too(name: str) -> None:
    """CONTRACT §9.2: the legacy types are byte-identical to ggml's reference quantizers; the importance matrix
    weights the k-quants' searches."""
    x = _data("heavy", (16, 256), seed=11)
    t = ggml.GGML_TYPES[name]
    imp = torch.from_numpy((np.random.default_rng(12).random(256) ** 3 * 5 + 1e-3).astype(np.float32))
    ref = gguf.quants.quantize(x, GGMLQuantizationType(t.type_id))
    assert np.array_equal(ggml.quantize(torch.from_numpy(x), t, importance=imp).data.numpy(), ref)


def test_importance_moves_error_to_unimportant_columns() -> None:
    x = torch.from_numpy(_data("gaussian", (64, 512), seed=5))
    imp = torch.ones(512)
    imp[:256] = 100.0
    t = ggml.GGML_TYPES["q4_k"]
    plain = ggml.dequantize(ggml.quantize(x, t)) - x
    weighted = ggml.dequantize(ggml.quantize(x, t, importance=imp)) - x
    assert (weighted[:, :256] ** 2).mean() < (plain[:, :256] ** 2).mean()


def test_shapes_are_checked_and_memory_is_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="multiple of 256"):
        ggml.quantize(torch.zeros(4, 96), ggml.GGML_TYPES["q4_k"], name="w")
    x = torch.from_numpy(_data("gaussian", (40, 256), seed=6))
    for name, exact in (("q8_0", True), ("q5_k", False)):
        t = ggml.GGML_TYPES[name]
        whole = ggml.quantize(x, t)
        with monkeypatch.context() as m:
            m.setattr(ggml, "CHUNK_ELEMENTS", 512)  # two rows a chunk
            m.setattr(ggml, "KQUANT_CHUNK_ELEMENTS", 512)
            parts = ggml.quantize(x, t)
        if exact:
            assert torch.equal(parts.data, whole.data)
        else:  # the searches' float32 sums may round otherwise in smaller tensors: the same error to 1 %
            e1, e2 = (((ggml.dequantize(q) - x) ** 2).mean().item() for q in (whole, parts))
            assert e2 == pytest.approx(e1, rel=1e-2)
    three_d = ggml.quantize(x.reshape(2, 20, 256), ggml.GGML_TYPES["q8_0"])
    # chunks of the given size, but a tensor of less than two chunks is split in two (two threads' work)
    assert ggml.rows_per_chunk(40, 256, ggml.CHUNK_ELEMENTS) == 20 and ggml.rows_per_chunk(1, 256, 1 << 18) == 1
    assert ggml.rows_per_chunk(10_000, 256, 1 << 19) == 2048 and ggml.rows_per_chunk(10_000, 256, 1 << 18) == 1024
    assert three_d.data.shape == (40, 272) and ggml.dequantize(three_d).shape == (2, 20, 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_cuda_gives_the_cpu_bytes_for_legacy_types(name: str) -> None:
    x = torch.from_numpy(_data("gaussian", (32, 512), seed=7))
    t = ggml.GGML_TYPES[name]
    cpu = ggml.quantize(x, t).data
    gpu = ggml.quantize(x.cuda(), t).data.cpu()
    if name in LEGACY:
        assert torch.equal(cpu, gpu)
    else:  # another summation order in the searches: decoded error within a hair of the CPU's
        e_cpu = ((ggml.dequantize(ggml.GGMLQuantized(t, x.shape, cpu)) - x) ** 2).mean()
        e_gpu = ((ggml.dequantize(ggml.GGMLQuantized(t, x.shape, gpu)) - x) ** 2).mean()
        assert e_gpu <= e_cpu * 1.01


def _make_q3_quants_reference(x: np.ndarray, nmax: int) -> float:
    """ggml's ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for one sub-block, as written in ggml-quants.c
    (float32 throughout): the scale it returns."""
    f = np.float32
    amax_i = int(np.argmax(np.abs(x)))
    if abs(x[amax_i]) < 1e-15:
        return 0.0
    iscale = f(-nmax) / x[amax_i]
    q = np.clip(np.round(x * iscale), -nmax, nmax - 1).astype(np.float32)
    w = x * x
    sumlx = f(np.sum(w * x * q, dtype=np.float32))
    suml2 = f(np.sum(w * q * q, dtype=np.float32))
    for _ in range(5):
        changed = 0
        for i in range(len(x)):
            slx = f(sumlx - w[i] * x[i] * q[i])
            if slx > 0:
                sl2 = f(suml2 - w[i] * q[i] * q[i])
                new_l = float(np.clip(np.round(x[i] * sl2 / slx), -nmax, nmax - 1))
                if new_l != q[i]:
                    slx = f(slx + w[i] * x[i] * f(new_l))
                    sl2 = f(sl2 + w[i] * f(new_l) * f(new_l))
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        q[i], sumlx, suml2 = new_l, slx, sl2
                        changed += 1
        if not changed:
            break
    return float(sumlx / suml2) if suml2 > 0 else 0.0


def test_q3_coordinate_descent_matches_ggml_loop_per_sub_block() -> None:
    """The vectorised make_q3_quants (later sweeps only on the sub-blocks still moving) gives each sub-block
    the scale of ggml's own loop, which stops each sub-block at its first sweep without a change."""
    from quantd.engine.ggml._search import q3_search

    x = _data("heavy", (300, 16), seed=7)
    ours = q3_search(torch.from_numpy(x), 4).numpy()
    ref = np.array([_make_q3_quants_reference(row, 4) for row in x], dtype=np.float32)
    close = np.isclose(ours, ref, rtol=1e-5, atol=0)
    assert close.mean() > 0.99, f"{(~close).sum()} of {len(ref)} sub-blocks differ"


def test_kquant_kernels_under_auto_wait_for_a_warm_up_to_build_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under QUANTD_COMPILE=auto the k-quant searches take no compiled kernel until a warm-up has built them
    (no job waits on a minutes-long compile); the warm-up's own thread takes them while it builds; from its end
    every thread does. ``off`` never, ``1`` always."""
    import threading

    from quantd.engine import kernels
    from quantd.engine.ggml._common import KQUANT_KERNELS, building_kernels, wants_kernels

    x = torch.zeros(64, 1024)
    monkeypatch.setattr(KQUANT_KERNELS, "built", threading.Event())
    kernels.KERNELS.reset(available=True)
    try:
        monkeypatch.setenv("QUANTD_COMPILE", "auto")
        assert not wants_kernels(x)
        elsewhere: list[bool] = []
        with building_kernels():
            assert wants_kernels(x) and KQUANT_KERNELS.warming.is_set()
            other = threading.Thread(target=lambda: elsewhere.append(wants_kernels(x)))
            other.start()
            other.join()
        assert elsewhere == [False]  # another thread (a job) stays eager while the warm-up builds
        assert not KQUANT_KERNELS.warming.is_set() and wants_kernels(x)
        monkeypatch.setenv("QUANTD_COMPILE", "0")
        assert not wants_kernels(x)
        monkeypatch.setattr(KQUANT_KERNELS, "built", threading.Event())
        monkeypatch.setenv("QUANTD_COMPILE", "1")
        assert wants_kernels(x)
        with pytest.raises(RuntimeError), building_kernels():  # a failed build leaves them unbuilt
            raise RuntimeError("compile failed")
        monkeypatch.setenv("QUANTD_COMPILE", "auto")
        assert not wants_kernels(x) and not KQUANT_KERNELS.built.is_set()
    finally:
        kernels.KERNELS.reset()
