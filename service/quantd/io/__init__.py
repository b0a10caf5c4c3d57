"""quantd.io: safe input readers, the artifact format and the file-level pipelines."""

from .artifact import (
    ArtifactWriter,
    LoadResult,
    dequantize_artifact,
    iter_dequantized,
    load_into_model,
    read_artifact_torch,
    write_dense,
)
from .formats import detect_format
from .pipeline import TensorPlan, analyze_file, calibrate_file, plan, quantize_file
from .readers import ModelReader, TensorInfo, open_model

__all__ = [
    "ArtifactWriter",
    "LoadResult",
    "ModelReader",
    "TensorInfo",
    "TensorPlan",
    "analyze_file",
    "calibrate_file",
    "dequantize_artifact",
    "detect_format",
    "iter_dequantized",
    "load_into_model",
    "open_model",
    "plan",
    "quantize_file",
    "read_artifact_torch",
    "write_dense",
]
