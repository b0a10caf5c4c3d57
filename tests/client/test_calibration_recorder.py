"""The SDK's CalibrationRecorder writes CONTRACT §10's calibration file: per Linear module ``M``, ``M.hessian``
(float32 ``[in, in]``, Σ x xᵀ) and ``M.hessian_count`` (int64, shape ``[]``), which the service reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_the_file_holds_each_linears_hessian_and_its_row_count(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from quantd.io.calibration import MethodCalibration
    from quantd_client.calibration import CalibrationRecorder

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 5, 8, generator=g), torch.randn(7, 8, generator=g)]  # leading dims are rows
    with torch.no_grad(), CalibrationRecorder(model, prefix="net.") as rec:
        for b in batches:
            model(b)
    assert not model[0]._forward_pre_hooks and not model[2]._forward_pre_hooks  # removed on exit
    rec.save(tmp_path / "cal.safetensors")

    data = load_file(str(tmp_path / "cal.safetensors"))
    assert set(data) == {"net.0.hessian", "net.0.hessian_count", "net.2.hessian", "net.2.hessian_count"}
    rows = torch.cat([b.reshape(-1, 8) for b in batches]).double()
    with torch.no_grad():
        hidden = torch.relu(model[0](rows.float())).double()
    for name, x in (("net.0", rows), ("net.2", hidden)):
        h, n = data[f"{name}.hessian"], data[f"{name}.hessian_count"]
        assert h.dtype == np.float32 and h.shape == (x.shape[1], x.shape[1])
        assert n.dtype == np.int64 and n.shape == () and int(n) == 22  # shape [] (a 0-d count was written [1])
        np.testing.assert_allclose(h, (x.T @ x).numpy(), rtol=1e-5, atol=1e-5)
    with MethodCalibration(tmp_path / "cal.safetensors") as cal:  # what the service reads of it
        cal.check_values()
        layer = cal.layer("net.2.weight", torch.device("cpu"))
    assert layer is not None and layer.count == 22
