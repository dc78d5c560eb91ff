"""The serving tools ferry carries across the gap, pinned: llama.cpp's converter inside one llama-cpp-python sdist.

Shared by ``ferry pack`` (which carries the file and the converter's Python needs when the spec asks for GGUF),
``ferry install`` and ``install.py`` (bundler/installer/prefix.py places :data:`TOOL_FILES` in ``PREFIX/tools/``)
and ``ferry export`` (exporter/gguf.py runs the converter). Standard library only: the bundle's stand-alone
``install.py`` is generated with this module in it (bundler/installer/generate.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sdist:
    """A pinned source distribution: PyPI project, version, file name, sha256, and the folder inside it that holds
    llama.cpp."""

    project: str
    version: str
    filename: str
    sha256: str
    llama_cpp: str


#: llama-cpp-python 0.3.36 (MIT), which vendors llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/);
#: 76.6 MB.
SDIST = Sdist(
    "llama-cpp-python",
    "0.3.36",
    "llama_cpp_python-0.3.36.tar.gz",
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "llama_cpp_python-0.3.36/vendor/llama.cpp/",
)
#: Python packages the converter imports beyond ferry's own requirements (ferry's ``gguf`` extra; ``gguf`` is the
#: PyPI reader that transformers and the static check use).
CONVERTER_REQUIREMENTS = ("sentencepiece>=0.1.98", "protobuf>=4.21", "numpy>=1.26", "PyYAML>=6", "gguf>=0.10")
#: Folder of an installed prefix that holds the tools.
TOOLS_DIR = "tools"
#: Serving targets a pack spec may ask for (``serving: [gguf]``, ``ferry pack --extra gguf``).
SERVING_TARGETS = ("gguf",)
#: Tool files by name -> sha256 (what ``ferry install`` places in ``PREFIX/tools``).
TOOL_FILES = {SDIST.filename: SDIST.sha256}
