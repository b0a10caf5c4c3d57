"""quantd.io: safe input readers, the artifact format and the file-level pipelines."""

from .artifact import ArtifactWriter, dequantize_artifact, load_into_model, read_artifact_torch
from .formats import detect_format
from .pipeline import TensorPlan, analyze_file, calibrate_file, plan, quantize_file
from .readers import ModelReader, TensorInfo, open_model

__all__ = [
    "ArtifactWriter",
    "ModelReader",
    "TensorInfo",
    "TensorPlan",
    "analyze_file",
    "calibrate_file",
    "dequantize_artifact",
    "detect_format",
    "load_into_model",
    "open_model",
    "plan",
    "quantize_file",
    "read_artifact_torch",
]
