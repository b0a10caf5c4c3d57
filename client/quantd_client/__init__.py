"""quantd_client: the Python SDK of quantd. Needs httpx, pydantic and numpy only."""

from typing import TYPE_CHECKING, Any

from ._artifact import ArtifactError, ArtifactFile, read_artifact
from ._dtypes import DTYPES, NF4_CODEBOOK, DTypeInfo, dtype_info
from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthError,
    BadRequest,
    ChecksumMismatch,
    Conflict,
    Gone,
    JobTimeout,
    NotFound,
    PayloadTooLarge,
    QuantdError,
    RateLimited,
    ServerError,
    StorageBusy,
    UnsupportedMedia,
    ValidationError,
)
from ._results import Artifact
from ._schemas import (
    AnalyzeResponse,
    AnalyzeResult,
    AnalyzeTensor,
    BitWidthResult,
    CalibrateResponse,
    DeviceInfo,
    ErrorStats,
    FileEntry,
    FileList,
    Info,
    InputInfo,
    Job,
    JobError,
    JobList,
    JobResult,
    LayerCalibration,
    Limits,
    ObserverSpec,
    OutlierImpactResult,
    Problem,
    Progress,
    QuantConfig,
    Report,
    Rule,
    ScaleSensitivityResult,
    Scheme,
    SchemeOverride,
    Summary,
    TensorAnalyses,
    TensorReport,
)

if TYPE_CHECKING:
    from ._async import AsyncClient
    from ._client import Client
    from ._job import AsyncJobHandle, JobHandle

__version__ = "0.1.0"

# The clients and job handles load httpx: imported on first use, so that the schemas alone (the CLI's
# in-process runs, the server) load without it.
_LAZY = {"AsyncClient": "._async", "Client": "._client", "AsyncJobHandle": "._job", "JobHandle": "._job"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DTYPES",
    "NF4_CODEBOOK",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AnalyzeResponse",
    "AnalyzeResult",
    "AnalyzeTensor",
    "Artifact",
    "ArtifactError",
    "ArtifactFile",
    "AsyncClient",
    "AsyncJobHandle",
    "AuthError",
    "BadRequest",
    "BitWidthResult",
    "CalibrateResponse",
    "ChecksumMismatch",
    "Client",
    "Conflict",
    "DTypeInfo",
    "DeviceInfo",
    "ErrorStats",
    "FileEntry",
    "FileList",
    "Gone",
    "Info",
    "InputInfo",
    "Job",
    "JobError",
    "JobHandle",
    "JobList",
    "JobResult",
    "JobTimeout",
    "LayerCalibration",
    "Limits",
    "NotFound",
    "ObserverSpec",
    "OutlierImpactResult",
    "PayloadTooLarge",
    "Problem",
    "Progress",
    "QuantConfig",
    "QuantdError",
    "RateLimited",
    "Report",
    "Rule",
    "ScaleSensitivityResult",
    "Scheme",
    "SchemeOverride",
    "ServerError",
    "StorageBusy",
    "Summary",
    "TensorAnalyses",
    "TensorReport",
    "UnsupportedMedia",
    "ValidationError",
    "__version__",
    "dtype_info",
    "read_artifact",
]
