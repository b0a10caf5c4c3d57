"""quantd: quantization service for ML weights."""

__version__ = "0.1.0"
