"""The one family of errors ferry raises.

Every error a user can cause (bad input, a corrupt bundle, a missing model) is a :class:`FerryError`.
The CLI catches ``FerryError`` and prints ``ferry: error: <message>`` on one line with a non-zero exit
code (``exit_code``); anything else is a bug and keeps its traceback.

Each class also subclasses the built-in exception it resembles (as huggingface_hub's ``errors.py`` does),
so callers may catch broadly (``except OSError``) or precisely (``except IntegrityError``).

This module uses only the standard library: the bundle's stand-alone ``install.py`` is generated with this
module in it (bundler/installer/generate.py), so a bare ``python3`` raises the very same classes.
"""

from __future__ import annotations


class FerryError(Exception):
    """Base class of every error ferry raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class ConfigError(FerryError, ValueError):
    """A config or spec is invalid: unknown key, wrong type, contradictory values. Names the key."""

    exit_code = 2


class DataError(FerryError, ValueError):
    """A dataset row or file is malformed. The message names the file and the row number."""

    exit_code = 3


class NotInstalledError(FerryError, FileNotFoundError):
    """A model, dataset or file is not available offline. The message says what to add to ``ferry pack``."""

    exit_code = 4


class SourceError(FerryError):
    """A source could not be fetched or is refused (e.g. pickle weights without ``--allow-pickle``)."""

    exit_code = 5


class BundleError(FerryError):
    """A bundle is unusable: unreadable, unknown format version, missing manifest."""

    exit_code = 6


class IntegrityError(BundleError):
    """Bytes on disk do not match the manifest: missing, extra, truncated or mismatched files."""

    exit_code = 7


class UnsafeArchiveError(BundleError):
    """An archive member would escape the destination (absolute path, ``..``, outside link, device)."""

    exit_code = 8


class InsufficientSpaceError(FerryError, OSError):
    """Too little free disk space for a large write; the message says how much is needed and where."""

    exit_code = 9


class PrefixError(FerryError, PermissionError):
    """An install prefix cannot be used: read-only, owned by another account, or drifted from its record."""

    exit_code = 13


class TrainingError(FerryError, RuntimeError):
    """Training cannot proceed (e.g. no trainable tokens, a worker failed)."""

    exit_code = 10


class ExportError(FerryError):
    """A merge or export is refused or failed (quantized base, adapter shapes that do not fit)."""

    exit_code = 11


class SmokeCheckError(ExportError):
    """The inference smoke check failed (logits differ, NaN/inf, no EOS)."""

    exit_code = 12


class ServingError(FerryError):
    """An inference server ferry started (``ferry chat`` with ``infer_backend: vllm`` / ``sglang``) did not come
    up, refused a request or went away."""

    exit_code = 14


class RegressionError(FerryError):
    """An evaluation gate failed: the tuned model scored worse than the base by more than the allowed drop
    (``ferry eval`` with ``max_drop``). The message names the task and the metric."""

    exit_code = 15


class EvaluationError(FerryError, RuntimeError):
    """An evaluation could not run to its end (``ferry eval`` on several ranks: a worker failed). The message names
    the first worker's error and the log file that holds the full output."""

    exit_code = 16


__all__ = [
    "FerryError",
    "ConfigError",
    "DataError",
    "NotInstalledError",
    "SourceError",
    "BundleError",
    "IntegrityError",
    "UnsafeArchiveError",
    "InsufficientSpaceError",
    "PrefixError",
    "TrainingError",
    "EvaluationError",
    "ExportError",
    "SmokeCheckError",
    "ServingError",
    "RegressionError",
]
