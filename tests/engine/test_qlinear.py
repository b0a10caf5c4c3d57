from __future__ import annotations

import pytest
import torch
from torch import nn

from quantd.engine.qlinear import QuantizedLinear, int8_matmul
from quantd.errors import ConfigError, MalformedInputError


def _layer(in_f: int = 64, out_f: int = 24, seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f)
    x = torch.randn(3, 7, in_f)
    return lin, x


def _reference_acc(q: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """Straightforward int64 reference: (x_q − zp_x) · w_qᵀ + b_q."""
    xq = torch.clamp(torch.round(x.reshape(-1, q.in_features) / q.input_scale) + q.input_zero_point, -128, 127)
    acc = (xq.long() - q.input_zero_point) @ q.weight_codes.long().t()
    return acc + (q.bias_codes.long() if q.bias_codes is not None else 0)


@pytest.mark.parametrize("zp", [0, -7, 20])
def test_exact_integer_accumulation(zp: int) -> None:
    lin, x = _layer()
    q = QuantizedLinear.from_float(lin, input_scale=float(x.abs().max()) / 120, input_zero_point=zp)
    ref = _reference_acc(q, x)
    xq = q.quantize_input(x.reshape(-1, 64))
    acc_mm = q.accumulate(xq)
    acc_f64 = q.accumulate(xq, use_int_mm=False)
    assert acc_mm.dtype == torch.int32
    assert torch.equal(acc_mm.long(), ref) and torch.equal(acc_f64.long(), ref)
    y = q(x)
    expected = (ref.double() * (q.input_scale * q.weight_scale.double())).float().reshape(3, 7, 24)
    assert torch.equal(y, expected)


def test_close_to_float_linear_within_error_bound() -> None:
    lin, x = _layer(seed=1)
    s_x = float(x.abs().max()) / 127
    q = QuantizedLinear.from_float(lin, input_scale=s_x)
    y = q(x).double()
    y_float = lin(x).detach().double()
    w = lin.weight.detach().double()
    s_w = q.weight_scale.double()
    # |x̂ŵ − xw| ≤ |x|·Δw + |w|·Δx + Δx·Δw per term, Δ = half a step; the bias rounds to half a step of s_x·s_w.
    xa = x.abs().double().reshape(-1, 64)
    bound = (xa @ (s_w / 2).expand(64, -1) + (s_x / 2) * w.abs().sum(1) + 64 * (s_x / 2) * (s_w / 2)
             + s_x * s_w / 2)
    err = (y - y_float).reshape(-1, 24).abs()
    assert bool((err <= bound * (1 + 1e-9)).all())
    assert float(err.max()) > 0  # it is quantized
    assert float(err.mean()) < 0.05 * float(y_float.abs().mean())


def test_int8_output_requantization() -> None:
    lin, x = _layer(seed=2)
    q_float = QuantizedLinear.from_float(lin, input_scale=float(x.abs().max()) / 127)
    y = q_float(x)
    s_y, zp_y = float(y.abs().max()) / 100, 3
    q = QuantizedLinear.from_float(lin, input_scale=q_float.input_scale, output_scale=s_y,
                                   output_zero_point=zp_y)
    yq = q(x)
    assert yq.dtype == torch.int8
    ref = torch.clamp(torch.round(y.double() / s_y) + zp_y, -128, 127)
    assert int((yq.double() - ref).abs().max()) <= 1  # equal up to float32 rounding at .5 ties
    assert float((yq.double() - ref).abs().mean()) < 0.01


def test_int8_matmul_paths_agree_and_shape_errors() -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-128, 128, (5, 40), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (9, 40), dtype=torch.int8, generator=g)
    ref = a.long() @ b.long().t()
    assert torch.equal(int8_matmul(a, b).long(), ref)
    assert torch.equal(int8_matmul(a, b, use_int_mm=False).long(), ref)
    lin, _ = _layer()
    q = QuantizedLinear.from_float(lin, input_scale=0.1)
    with pytest.raises(MalformedInputError, match="features"):
        q(torch.randn(2, 63))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [5, 32])  # 5: the float64 fallback; 32: torch._int_mm
def test_cuda_accumulation_is_exact(rows: int) -> None:
    lin, _ = _layer()
    x = torch.randn(rows, 64)
    q = QuantizedLinear.from_float(lin, input_scale=float(x.abs().max()) / 120, input_zero_point=3)
    ref = _reference_acc(q, x)
    qc = q.cuda()
    acc = qc.accumulate(qc.quantize_input(x.cuda()))
    assert torch.equal(acc.cpu().long(), ref)


def test_pruned_and_tiny_rows_keep_their_bias() -> None:
    # An all-zero row's absmax scale is the smallest float32, so its bias code would clamp to ±2³¹, and a row
    # of ~1e-7 weights would overflow int32 when the bias is added: such rows' scales leave the bias room in
    # the accumulator.
    torch.manual_seed(0)
    lin = nn.Linear(64, 8)
    with torch.no_grad():
        lin.weight[3] = 0.0
        lin.weight[5] *= 1e-6
        lin.bias[:] = torch.linspace(-0.5, 0.5, 8)
    x = torch.randn(4, 64)
    q = QuantizedLinear.from_float(lin, input_scale=float(x.abs().max()) / 127)
    y, y_float = q(x).double(), lin(x).detach().double()
    assert torch.allclose(y[:, [3, 5]], y_float[:, [3, 5]], rtol=1e-6, atol=0)
    assert torch.equal(q.accumulate(q.quantize_input(x)).long(), _reference_acc(q, x))  # no wrap-around
    assert int(q.bias_codes.abs().max()) <= 2**31 - 1 - 64 * 255 * 128  # type: ignore[union-attr]
    untouched = [0, 1, 2, 4, 6, 7]  # rows whose biases fit keep their min-max scales
    want = lin.weight.detach().abs().amax(1)[untouched] / 127.5
    assert torch.allclose(q.weight_scale[untouched], want, rtol=1e-6)


def test_a_bias_code_beyond_the_accumulator_headroom_is_refused() -> None:
    codes = torch.zeros(2, 64, dtype=torch.int8)
    with pytest.raises(ConfigError, match="overflow the int32 accumulator"):
        QuantizedLinear(codes, torch.ones(2), torch.tensor([0, 2**31 - 1], dtype=torch.int32), input_scale=1.0)


def test_state_dict_round_trip_into_a_placeholder_layer() -> None:
    lin, x = _layer(seed=3)
    q = QuantizedLinear.from_float(lin, input_scale=float(x.abs().max()) / 127, input_zero_point=3,
                                   output_scale=0.05, output_zero_point=-2)
    for bias in (None, torch.zeros(24, dtype=torch.int32)):  # a placeholder made with or without a bias
        fresh = QuantizedLinear(torch.zeros(24, 64, dtype=torch.int8), torch.ones(24), bias, input_scale=1.0)
        fresh.load_state_dict(q.state_dict())
        assert torch.equal(fresh(x), q(x))
        assert (fresh.input_scale, fresh.input_zero_point, fresh.output_scale, fresh.output_zero_point) == \
            (q.input_scale, q.input_zero_point, q.output_scale, q.output_zero_point)
    lin.bias = None
    q_nobias = QuantizedLinear.from_float(lin, input_scale=0.1)
    fresh = QuantizedLinear(torch.zeros(24, 64, dtype=torch.int8), torch.ones(24), torch.zeros(24, dtype=torch.int32),
                            input_scale=1.0)
    fresh.load_state_dict(q_nobias.state_dict())
    assert fresh.bias_codes is None and torch.equal(fresh(x), q_nobias(x))


def test_older_and_partial_state_dicts_load() -> None:
    lin, x = _layer(seed=4)
    q = QuantizedLinear.from_float(lin, input_scale=0.05)
    old = {k: v for k, v in q.state_dict().items() if k != "_extra_state"}  # saved before it carried the scales
    fresh = QuantizedLinear(torch.zeros(24, 64, dtype=torch.int8), torch.ones(24), torch.zeros(24, dtype=torch.int32),
                            input_scale=0.05)
    fresh.load_state_dict(old)  # strict: no "missing _extra_state"
    assert torch.equal(fresh(x), q(x))
    fresh.load_state_dict({"weight_scale": q.weight_scale}, strict=False)  # a partial load keeps the bias
    assert fresh.bias_codes is not None and torch.equal(fresh.bias_codes, q.bias_codes)  # type: ignore[arg-type]
