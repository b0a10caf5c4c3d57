"""Pins the public surface of quantd_client (as httpx's tests/test_exported_members.py does)."""

import quantd_client

EXPECTED = {
    "Client", "AsyncClient", "JobHandle", "AsyncJobHandle", "Artifact", "ArtifactFile", "ArtifactError",
    "read_artifact", "QuantConfig", "Scheme", "SchemeOverride", "Rule", "ErrorStats", "Summary", "Report",
    "TensorReport", "Job", "JobList", "JobResult", "JobError", "InputInfo", "Progress", "Problem",
    "AnalyzeResponse", "AnalyzeResult", "AnalyzeTensor", "ObserverSpec", "LayerCalibration",
    "CalibrateResponse", "Info", "DeviceInfo", "Limits", "DTYPES", "NF4_CODEBOOK", "DTypeInfo", "dtype_info",
    "QuantdError", "APIStatusError", "BadRequest", "AuthError", "NotFound", "Conflict", "Gone", "PayloadTooLarge",
    "UnsupportedMedia", "ValidationError", "RateLimited", "ServerError", "APIConnectionError",
    "APITimeoutError", "ChecksumMismatch", "JobTimeout", "StorageBusy", "__version__",
    "BitWidthResult", "OutlierImpactResult", "ScaleSensitivityResult", "TensorAnalyses",
    "FileEntry", "FileList",
}


def test_all_is_pinned() -> None:
    assert set(quantd_client.__all__) == EXPECTED


def test_every_exported_name_exists_and_is_public() -> None:
    for name in quantd_client.__all__:
        assert hasattr(quantd_client, name), name
        obj = getattr(quantd_client, name)
        module = getattr(obj, "__module__", "quantd_client") or "quantd_client"
        assert module.startswith("quantd_client"), (name, module)


def test_contract_errors_derive_from_quantd_error() -> None:
    for name in ("BadRequest", "AuthError", "NotFound", "Conflict", "Gone", "PayloadTooLarge", "UnsupportedMedia",
                 "ValidationError", "RateLimited", "ServerError"):
        assert issubclass(getattr(quantd_client, name), quantd_client.QuantdError)


def test_gone_is_a_conflict_as_410_was_before() -> None:
    assert issubclass(quantd_client.Gone, quantd_client.Conflict)
