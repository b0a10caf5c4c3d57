from __future__ import annotations

import pytest
import torch

from quantd.engine.primitives import fake_quantize
from quantd.engine.qat import LSQ, FakeQuantize, FakeQuantizeClamped, FakeQuantizeSTE, fake_quant
from quantd.errors import ConfigError
from quantd_client import Scheme

QMIN, QMAX = -8, 7


def _x() -> torch.Tensor:
    return torch.linspace(-3.0, 3.0, 41, dtype=torch.float64)


def test_ste_gradient_is_identity_even_when_clamped() -> None:
    x = _x().requires_grad_()
    s, zp = torch.tensor(0.1, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    y = FakeQuantizeSTE.apply(x, s, zp, QMIN, QMAX)
    g = torch.randn(41, dtype=torch.float64)
    y.backward(g)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(y.detach(), fake_quant(x.detach(), s, zp, QMIN, QMAX))
    assert float(y.detach().max()) == pytest.approx((QMAX - 2) * 0.1)  # the forward did clamp


def test_clamped_ste_is_zero_outside_the_representable_range() -> None:
    x = _x().requires_grad_()
    s, zp = torch.tensor(0.25, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    y = FakeQuantizeClamped.apply(x, s, zp, QMIN, QMAX)
    y.backward(torch.ones(41, dtype=torch.float64))
    lo, hi = (QMIN - 1) * 0.25, (QMAX - 1) * 0.25  # [-2.25, 1.5]
    inside = (x.detach() >= lo) & (x.detach() <= hi)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, inside.double())
    assert 0 < int(inside.sum()) < 41


def test_lsq_gradcheck_where_exact() -> None:
    # All elements clamped: the forward is linear in the scale, so the LSQ gradient is the true one.
    x = torch.tensor([5.0, -7.0, 9.0, -12.0], dtype=torch.float64)
    s = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    zp = torch.tensor([1.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda sc: LSQ.apply(x, sc, zp, QMIN, QMAX, 1.0), (s,))


def test_lsq_scale_gradient_matches_finite_differences() -> None:
    # Inside the range the forward is s·round(x/s) (locally constant codes); LSQ adds the STE term −x/s.
    s0, zp = 0.2, 0.0
    x = torch.tensor([0.05, -0.33, 0.61, 1.27, -1.49, 3.0, -4.0, 0.97], dtype=torch.float64)  # 2 clamped
    g = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0, 2.0, 0.7, -0.3], dtype=torch.float64)
    zpt = torch.tensor(zp, dtype=torch.float64)

    def loss(s: float) -> float:
        return float((g * fake_quant(x, torch.tensor(s, dtype=torch.float64), zpt, QMIN, QMAX)).sum())

    h = 1e-6
    fd = (loss(s0 + h) - loss(s0 - h)) / (2 * h)
    u = x / s0
    inside = (u.round() >= QMIN) & (u.round() <= QMAX)
    expected = fd - float((g * u * inside).sum())
    grad_scale = 0.37
    s = torch.tensor(s0, dtype=torch.float64, requires_grad=True)
    LSQ.apply(x, s, zpt, QMIN, QMAX, grad_scale).backward(g)
    assert s.grad is not None
    assert float(s.grad) == pytest.approx(expected * grad_scale, rel=1e-6)


def test_lsq_per_channel_gradient_shape_and_reduction() -> None:
    x = torch.randn(3, 5, dtype=torch.float64)
    s = torch.tensor([[0.1], [0.2], [0.3]], dtype=torch.float64, requires_grad=True)
    zp = torch.zeros(3, 1, dtype=torch.float64)
    LSQ.apply(x, s, zp, QMIN, QMAX, 1.0).sum().backward()
    assert s.grad is not None and s.grad.shape == (3, 1)
    for i in range(3):
        si = s[i].detach().clone().requires_grad_()
        LSQ.apply(x[i], si, zp[i], QMIN, QMAX, 1.0).sum().backward()
        assert si.grad is not None
        torch.testing.assert_close(s.grad[i], si.grad)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_module_observes_then_freezes_and_matches_engine(granularity: str) -> None:
    scheme = Scheme(dtype="int8", symmetric=False, granularity=granularity, scale_dtype="float32")
    fq = FakeQuantize(scheme)
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fq(w), fake_quantize(w, scheme))
    fq.freeze()
    scale = fq.scale.clone()
    y = fq(w * 10)  # frozen: the bigger input is clamped, the scale unchanged
    torch.testing.assert_close(fq.scale, scale)
    assert float(y.abs().max()) <= float(w.abs().max()) * 1.01


def test_learnable_scale_trains() -> None:
    torch.manual_seed(0)
    fq = FakeQuantize(Scheme(dtype="int4", symmetric=True, granularity="tensor", scale_dtype="float32"),
                      learnable=True)
    w = torch.randn(256, dtype=torch.float32)
    fq(w)
    fq.freeze()
    assert isinstance(fq.scale, torch.nn.Parameter)
    opt = torch.optim.Adam(fq.parameters(), lr=0.01)
    first = None
    for _ in range(60):
        opt.zero_grad()
        loss = (fq(w) - w).pow(2).mean()
        first = first if first is not None else float(loss.detach())
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float((fq(w) - w).pow(2).mean())
    assert first is not None and final < 0.9 * first  # from the minmax init the MSE drops


def test_module_rejects_non_integer_and_unobserved() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        FakeQuantize(Scheme(dtype="nf4"))
    fq = FakeQuantize(Scheme(dtype="int8", granularity="tensor"))
    fq.freeze()
    with pytest.raises(ConfigError, match="scale"):
        fq(torch.randn(3))


def test_the_half_step_beyond_either_end_is_outside() -> None:
    # s = 0.25, zp = 2: the range is [(qmin − zp)·s, (qmax − zp)·s] = [−2.5, 1.25]. x = −2.6 and 1.3 round
    # onto the end codes but lie outside it: the documented (and LSQ's) gradients are those of clamped
    # values, not the rounded code's, and both ends treat the half-step tie alike: x = (qmin − zp − ½)·s and
    # (qmax − zp + ½)·s are both outside.
    s, zp = torch.tensor(0.25, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    x = torch.tensor([-2.6, -2.625, -2.5, 1.25, 1.3, 1.375, 0.3], dtype=torch.float64, requires_grad=True)
    FakeQuantizeClamped.apply(x, s, zp, QMIN, QMAX).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [0, 0, 1, 1, 0, 0, 1]
    x.grad = None
    s_l = s.clone().requires_grad_()
    LSQ.apply(x, s_l, zp, QMIN, QMAX, 1.0).backward(torch.tensor([0, 0, 0, 0, 1, 0, 0], dtype=torch.float64))
    assert s_l.grad is not None and float(s_l.grad) == QMAX - 2  # clamped above: qmax − zp, not round(u) − u


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_keeps_a_low_precision_input_dtype_and_quantizes_in_float32(granularity: str,
                                                                           dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 256).to(dtype)
    fq = FakeQuantize(Scheme(dtype="int8", symmetric=True, granularity=granularity), axis=0)
    y = fq(x)
    assert y.dtype == dtype  # per channel it came back float32
    fq32 = FakeQuantize(Scheme(dtype="int8", symmetric=True, granularity=granularity), axis=0)
    want = fq32(x.float())  # the same values quantized in float32 (x / s was rounded in float16/bfloat16)
    torch.testing.assert_close(fq.scale, fq32.scale)
    assert torch.equal(y, want.to(dtype))


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_state_dict_round_trip_keeps_a_frozen_module_frozen(granularity: str) -> None:
    torch.manual_seed(0)
    fq = FakeQuantize(Scheme(dtype="int8", granularity=granularity), axis=0)
    fq(torch.randn(8, 32))
    fq.freeze()
    fresh = FakeQuantize(Scheme(dtype="int8", granularity=granularity), axis=0)
    fresh.load_state_dict(fq.state_dict())  # per channel: "size mismatch for scale: [8] vs []"
    x = torch.randn(8, 32) * 5
    assert torch.equal(fresh(x), fq(x))  # not re-observed: the loaded scale stays
    assert not fresh.observing and torch.equal(fresh.scale, fq.scale)


def test_an_empty_batch_passes_through() -> None:
    fq = FakeQuantize(Scheme(dtype="int8", symmetric=True, granularity="tensor"))
    empty = torch.empty(0, 16)
    assert fq(empty).shape == (0, 16)
    x = torch.randn(4, 16)
    assert torch.equal(fq(x), FakeQuantize(Scheme(dtype="int8", symmetric=True, granularity="tensor"))(x))  # nothing was observed
