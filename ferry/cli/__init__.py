"""The ``ferry`` command line: a thin click layer over the library functions.

Each sub-command parses its options, calls one library function and prints its report. A
:class:`ferry.errors.FerryError` becomes ``ferry: error: <message>`` on stderr and the error's exit code; so does a
write error of the host that no command turned into its own line (a full disk or quota, a read-only or forbidden
folder: :func:`_host_write_line`).
This sub-package is the top of the house: it imports ``bundler``, ``trainer``, ``exporter`` and ``evaluation`` (the
commands, and ``ferry demo`` in :mod:`ferry.cli.demo`); nothing below imports it back.

    pack.py, inspect.py, bundle.py (verify, install, env), delta.py (state), train.py, export.py, eval.py,
    chat.py, serve.py, demo_command.py: one module per command group, each with a ``COMMANDS`` list, imported when
    one of its commands is asked for (:data:`COMMAND_MODULES`)
"""

from __future__ import annotations

import errno
import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from ferry import __version__
from ferry.constants import INSTALL_JOURNAL, ferry_home
from ferry.errors import FerryError, InsufficientSpaceError

#: Commands that read the installed prefix named by ``$FERRY_HOME`` (``source PREFIX/ferry.env``): an install
#: interrupted part-way there is rolled back before they start (:func:`bundler.recover_interrupted_install`).
READS_PREFIX = frozenset({"train", "export", "smoke", "eval", "chat", "serve"})


def _recover_prefix() -> None:
    home = ferry_home()
    if home is None or not (home / INSTALL_JOURNAL).is_file():
        return
    from bundler import recover_interrupted_install

    recover_interrupted_install(home, log=lambda message: click.echo(f"ferry: {message}", err=True))


#: Every command's name and the module of this package that defines it (in the module's ``COMMANDS``). A command's
#: module is imported when that command runs, or when ``ferry --help`` lists them all: ``ferry serve`` need not import
#: the bundler, the trainer and lm-eval's task index first (half a second of every start).
COMMAND_MODULES = {
    "pack": "pack",
    "inspect": "inspect",
    "verify": "bundle",
    "install": "bundle",
    "env": "bundle",
    "state": "delta",
    "train": "train",
    "export": "export",
    "smoke": "export",
    "eval": "eval",
    "demo": "demo_command",
    "chat": "chat",
    "serve": "serve",
}


class LazyGroup(click.Group):
    """A click group whose commands (:data:`COMMAND_MODULES`) are imported when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMAND_MODULES, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            self.load(COMMAND_MODULES[cmd_name])
        return self.commands.get(cmd_name)

    def load(self, module_name: str) -> None:
        """Add the commands of ``ferry.cli.MODULE_NAME``; those that read the prefix roll back an interrupted
        install first (:func:`_after_recovery`)."""
        import importlib

        for command in importlib.import_module(f"ferry.cli.{module_name}").COMMANDS:
            if command.name in READS_PREFIX and command.callback is not None:
                command.callback = _after_recovery(command.callback)
            self.add_command(command)

    def load_all(self) -> dict[str, click.Command]:
        """Every command, imported: ``{name: command}``."""
        for module_name in dict.fromkeys(COMMAND_MODULES.values()):
            if not all(name in self.commands for name, m in COMMAND_MODULES.items() if m == module_name):
                self.load(module_name)
        return dict(self.commands)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="ferry")
def cli() -> None:
    """Carry LLM fine-tuning across an air gap.

    \b
    Online host:    ferry pack SPEC.yaml -o OUT
    Isolated host:  ferry inspect OUT/NAME.ferry.tar --html review.html
                    ferry verify OUT/NAME.ferry.tar --allowed-signers allowed_signers
                    ferry install OUT/NAME.ferry.tar --prefix /opt/ferry
                    source /opt/ferry/ferry.env
                    ferry train config.yaml
                    ferry export --adapter saves/run/adapter --output merged
                    ferry serve merged --check
                    ferry eval eval.yaml
    """


def _after_recovery(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` (a command's) that first rolls back an install interrupted in ``$FERRY_HOME``
    (:func:`_recover_prefix`). Click runs a callback once the arguments are parsed: ``--help`` and a usage error
    never reach it, so they change nothing."""

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        _recover_prefix()
        return callback(*args, **kwargs)

    return run


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI, turning FerryError into one line and a non-zero exit."""
    try:
        cli.main(args=argv, prog_name="ferry", standalone_mode=False)
    except FerryError as exc:
        click.echo(f"ferry: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("ferry: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:  # raised past the command's own handling: one line when the host refused a write
        line = _host_write_line(exc)
        if line is None:
            raise
        click.echo(f"ferry: error: {line}", err=True)
        sys.exit(
            InsufficientSpaceError.exit_code if exc.errno in (errno.ENOSPC, errno.EDQUOT) else FerryError.exit_code
        )


def _host_write_line(exc: OSError) -> str | None:
    """``cannot write FILE: STRERROR; N free in FOLDER`` for a write error of the host
    (:data:`ferry.fsutil.HOST_WRITE_ERRNOS`; the free space, of the nearest existing folder above the file, for a
    full disk or quota), then what to do; None for any other ``OSError`` (a bug, which keeps its traceback)."""
    from pathlib import Path

    from ferry.fsutil import host_write_error

    if not exc.filename:
        return host_write_error(exc, "what the command was writing", None)
    where = Path(str(exc.filename)).parent
    while not where.is_dir() and where != where.parent:
        where = where.parent
    line = host_write_error(OSError(exc.errno, exc.strerror), str(exc.filename), where)
    if line is None:
        return None
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return f"{line}; {'make room' if full else 'choose a folder this account can write'} and run the command again"


if __name__ == "__main__":
    main()
