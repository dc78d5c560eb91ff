"""exporter: streaming LoRA merge into sharded safetensors, and an inference smoke check.

Public API::

    export(adapter, output, base=None, ...) -> ExportReport   exporter.export
    smoke(model_dir, adapter=None, base=None, ...) -> SmokeReport   exporter.smoke
"""

from __future__ import annotations

from exporter.export import ExportReport, export
from exporter.smoke import SmokeReport, smoke

__all__ = [
    "ExportReport",
    "SmokeReport",
    "export",
    "smoke",
]
