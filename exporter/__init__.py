"""exporter: streaming LoRA merge into sharded safetensors, GGUF / Ollama outputs, and an inference smoke check.

Public API::

    ExportOptions                                           exporter.options (what to merge into, what to write)
    export(adapter, output, options) -> ExportReport        exporter.export
    smoke(model_dir, adapter=None, base=None, ...) -> SmokeReport   exporter.smoke

``ExportOptions`` is light and imported here: ``ferry export`` builds its flags from it without waiting for torch.
``ExportReport`` and ``SmokeReport`` import torch on first use. The two functions are imported from their modules
(``from exporter.export import export``): a package attribute cannot be both the function and, once imported,
the module of the same name without importing that module (and torch) with the package.
"""

from __future__ import annotations

import importlib
from typing import Any

from exporter.options import ExportOptions

_LAZY = {"ExportReport": "exporter.export", "SmokeReport": "exporter.smoke"}

__all__ = ["ExportOptions", "ExportReport", "SmokeReport"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
