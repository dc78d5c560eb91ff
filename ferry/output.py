"""What reaches the terminal: ferry's own lines and progress, nothing from the libraries under it.

transformers, peft, huggingface_hub and datasets write progress bars ("Loading weights") and warnings
(deprecations, peft's notes) to stderr. :func:`route_library_output` sends them to a log file instead
(``output_dir/logs/`` for a training run), unless ``--verbose`` (``FERRY_VERBOSE=1``). :func:`progress_is_live`
tells whether a progress bar may redraw itself: only on a terminal. Elsewhere (CI, ``| tee``, Slurm logs) ferry's
progress is one plain line per logging step, without carriage returns.

Standard library only at import; the libraries are configured only if they are importable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

#: ``1``: the libraries' output goes to the terminal as they write it (``ferry train --verbose``).
VERBOSE_ENV = "FERRY_VERBOSE"
#: Set by ``ferry train`` for its workers, whose stderr is a pipe: ``1`` when the launcher's stderr is a terminal.
TTY_ENV = "FERRY_TTY"
#: The loggers whose records go to the log file.
LIBRARY_LOGGERS = (
    "transformers",
    "peft",
    "huggingface_hub",
    "datasets",
    "accelerate",
    "torch",
    "bitsandbytes",
    "lm_eval",
    "py.warnings",
)


def verbose() -> bool:
    """True when ``FERRY_VERBOSE=1``: leave the libraries' output on the terminal."""
    return os.environ.get(VERBOSE_ENV) == "1"


def progress_is_live(stream=None) -> bool:
    """Whether a progress bar may redraw in place on ``stream`` (default stderr): it is a terminal, or this is a
    worker of a ``ferry train`` whose own stderr is one (``FERRY_TTY=1``)."""
    if os.environ.get(TTY_ENV) in ("0", "1"):
        return os.environ[TTY_ENV] == "1"
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class _LazyFileHandler(logging.FileHandler):
    """A FileHandler that creates its folder (``logs/``) and file on the first record only, and only once the
    folder's parent (the run's output_dir) exists: records before that wait in memory. So a run that logs
    nothing leaves no file, and a run refused before it made its output_dir leaves none behind."""

    def __init__(self, filename: Path, held: bool = False, **kwargs) -> None:
        super().__init__(filename, **kwargs)
        self.pending: list[logging.LogRecord] = []
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if self.held or not Path(self.baseFilename).parent.parent.is_dir():
            self.pending.append(record)
            return
        waiting, self.pending = self.pending, []
        for earlier in waiting:
            super().emit(earlier)
        super().emit(record)

    def _open(self):  # noqa: ANN202 - logging's own signature
        Path(self.baseFilename).parent.mkdir(exist_ok=True)
        return super()._open()


_routed: dict[str, logging.Handler] = {}


def route_library_output(log_file: Path | str, held: bool = False) -> Path | None:
    """Send the libraries' log records, Python warnings and progress bars to ``log_file`` (appended; created on
    the first record once the folder above its own exists, see :class:`_LazyFileHandler`), unless :func:`verbose`.
    ``held``: keep the records in memory until :func:`release_library_output` (a command that may still be refused
    writes nothing into its output folder). Returns the file, or None when verbose. Idempotent per process:
    a second call with another file moves the records there.

    Progress bars of transformers and huggingface_hub are turned off (a bar cannot go to a file usefully);
    warnings (``warnings.warn``, e.g. transformers' FutureWarnings) become records of ``py.warnings``.
    """
    if verbose():
        return None
    path = Path(log_file).absolute()
    handler = _LazyFileHandler(path, held=held, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        old = _routed.get(name)
        if old is not None:
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.propagate = False
        _routed[name] = handler
    logging.captureWarnings(True)
    warnings.simplefilter("default")  # every distinct warning once per place, to the file
    try:
        import transformers.utils.logging as tlog
    except ImportError:
        pass
    else:
        tlog.disable_default_handler()  # its own stderr handler; records now reach the file above
        tlog.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        pass
    else:
        disable_progress_bars()
    return path


def release_library_output() -> None:
    """Let the records held by :func:`route_library_output` (``held=True``) go to the log file, the ones held so
    far first."""
    for handler in {id(h): h for h in _routed.values()}.values():
        if isinstance(handler, _LazyFileHandler) and handler.held:
            handler.held = False
            waiting, handler.pending = handler.pending, []
            for record in waiting:
                handler.emit(record)


def drop_library_handlers() -> None:
    """Call after importing a library that gives its logger a stderr handler of its own on import (``datasets``
    does): while :func:`route_library_output` is in force, every handler but the log file's is removed from the
    routed loggers, so the library's records reach only the file. Nothing happens when nothing is routed."""
    for name, ours in _routed.items():
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if handler is not ours:
                logger.removeHandler(handler)


def unroute_library_output() -> None:
    """Undo :func:`route_library_output` in this process: the libraries' loggers lose the file handler and
    propagate again, Python warnings are printed again, and transformers' stderr handler and progress bars and
    huggingface_hub's bars are back, as in a process that never routed them."""
    for name, handler in list(_routed.items()):
        logger = logging.getLogger(name)
        logger.removeHandler(handler)
        logger.propagate = True
        handler.close()
    _routed.clear()
    logging.captureWarnings(False)
    try:
        import transformers.utils.logging as tlog
    except ImportError:
        pass
    else:
        tlog.enable_default_handler()
        tlog.enable_progress_bar()
    try:
        from huggingface_hub.utils import enable_progress_bars
    except ImportError:
        pass
    else:
        enable_progress_bars()


class ProgressLines:
    """ferry's progress where a bar cannot redraw: one line per call of :meth:`line`, to ``stream``
    (default stderr), flushed. ``prefix`` starts each line (e.g. ``"ferry: train"``)."""

    def __init__(self, prefix: str, total: int, stream=None) -> None:
        self.prefix, self.total = prefix, total
        self.stream = sys.stderr if stream is None else stream

    def line(self, step: int, **fields: str) -> None:
        """``PREFIX step N/TOTAL (P%) key value ...``"""
        pct = f" ({100 * step // self.total}%)" if self.total else ""
        extra = "".join(f", {k} {v}" for k, v in fields.items())
        self.stream.write(f"{self.prefix} step {step}/{self.total}{pct}{extra}\n")
        self.stream.flush()


@contextlib.contextmanager
def libraries_to(log_file: Path | str) -> Iterator[Path | None]:
    """For the block, everything written to stderr goes to ``log_file`` (appended), then stderr is as before: the
    libraries' log records, warnings and progress bars (:func:`route_library_output`, kept after the block), and
    whatever is written to ``sys.stderr`` or to file descriptor 2, by subprocesses too (lm-eval's progress bars, the
    ``git describe`` it runs to record a commit, "fatal: not a git repository" outside a repository). Yields the
    file, or None with :func:`verbose` (nothing is moved). An exception leaving the block is raised after stderr is
    back, so ferry reports it on the terminal."""
    if verbose():
        yield None
        return
    path = Path(log_file).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    route_library_output(path)
    sys.stderr.flush()
    saved_fd, saved_stream = os.dup(2), sys.stderr
    try:
        with open(path, "a", encoding="utf-8") as log:
            os.dup2(log.fileno(), 2)
            sys.stderr = log
            try:
                yield path
            finally:
                log.flush()
                sys.stderr = saved_stream
                os.dup2(saved_fd, 2)
    finally:
        os.close(saved_fd)


__all__ = [
    "LIBRARY_LOGGERS",
    "TTY_ENV",
    "VERBOSE_ENV",
    "ProgressLines",
    "libraries_to",
    "progress_is_live",
    "route_library_output",
    "verbose",
]
