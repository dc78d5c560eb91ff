"""How a field of an options model appears on the command line, beyond what the field itself says.

A library function takes one pydantic options model (:class:`exporter.options.ExportOptions`); its ``ferry``
command gets one flag per field from :func:`ferry.cli.flags.model_options`, which reads the field: the name
(``max_shard_size`` -> ``--max-shard-size``), the default, the description as help, ``Literal`` choices and
``Field(ge=...)`` limits. A :class:`Flag` in the field's ``Annotated[...]`` metadata adds what the type cannot
say::

    base: Annotated[str | None, Flag(metavar="MODEL")] = Field(None, description="Base model folder ...")
    prompts: Annotated[list[str] | None, Flag(name="prompt", repeat=True)] = Field(None, description="...")
    progress: Annotated[bool, Flag(cli=False)] = Field(False, description="...")

Standard library only: the options models live below ``ferry.cli`` and must not import click.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Flag:
    """Command-line hints for one options field.

    Attributes:
        name: the flag without its dashes when it is not the field's name with ``-`` for ``_`` (``format`` for
            ``formats``).
        metavar: the placeholder shown in ``--help`` (``MODEL``).
        repeat: the flag may be given several times, each time adding one item to the field's list.
        existing: the value must be an existing ``"path"`` (file or folder) or ``"dir"`` (folder), checked by
            click before the library sees it.
        cli: False for a field that only library callers set (the command sets it itself).
    """

    name: str | None = None
    metavar: str | None = None
    repeat: bool = False
    existing: Literal["path", "dir"] | None = None
    cli: bool = True


#: The hints of a field that carries no :class:`Flag`.
NO_HINTS = Flag()


def flag_of(metadata: list[Any]) -> Flag:
    """The :class:`Flag` among a field's metadata (pydantic's ``FieldInfo.metadata``), else :data:`NO_HINTS`."""
    return next((m for m in metadata if isinstance(m, Flag)), NO_HINTS)


__all__ = ["Flag", "NO_HINTS", "flag_of"]
