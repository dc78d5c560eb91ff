"""exporter: streaming LoRA merge into sharded safetensors, and an inference smoke check.

Public API (imported lazily)::

    export(adapter, output, base=None, ...) -> ExportReport   exporter.export
    smoke(model_dir, adapter=None, base=None, ...) -> SmokeReport   exporter.smoke
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "export": "exporter.export",
    "ExportReport": "exporter.export",
    "smoke": "exporter.smoke",
    "SmokeReport": "exporter.smoke",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
