"""Click flags generated from a pydantic options model (after mergekit's ``MergeOptions`` and its
``add_merge_options`` decorator): the model is the single source of the flags' names, defaults, help and limits.

For each field, in the model's order (``ferry.flags`` describes the hints a field may carry):

==========================  ===================================================================================
field                       flag
==========================  ===================================================================================
``bool``, default False     ``--name`` (a switch)
``bool``, default True      ``--name/--no-name``
``Literal[...]``            ``--name [a|b|c]`` (``click.Choice``)
``int`` with ``ge=N``       ``--name INTEGER RANGE`` (``click.IntRange(N)``)
``Flag(repeat=True)``       ``--name`` given several times, the values collected in order
``Flag(existing=...)``      ``--name PATH`` / ``DIRECTORY`` that must exist
anything else               ``--name TEXT``, the text handed to the model's validators
==========================  ===================================================================================

The description is the help text; a default other than None / False is shown (a tuple as ``a,b``). The command
passes :func:`given_options` to the model, so that the model's defaults apply and a caller can tell a flag given
from a default (``model_fields_set``: LLaMA-Factory's merge YAML yields to given flags only).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click
from click.core import ParameterSource
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ferry.flags import Flag, flag_of

F = TypeVar("F", bound=Callable[..., Any])


def _plain(annotation: Any) -> Any:
    """``X | None`` -> ``X``; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _click_type(field: FieldInfo, flag: Flag) -> Any:
    """The click parameter type of ``field``: a path, a choice, an integer range, or text."""
    annotation = _plain(field.annotation)
    if flag.existing is not None:
        return click.Path(exists=True, file_okay=flag.existing == "path")
    if typing.get_origin(annotation) is Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)])
    if annotation is int:
        low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
        return click.INT if low is None else click.IntRange(low)
    return click.STRING


def _default(value: Any) -> Any:
    """A field default as click shows and passes it: a tuple as its comma-joined text."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def option_for(name: str, field: FieldInfo) -> Callable[[F], F] | None:
    """The ``click.option`` decorator of one model field, or None for a field without a flag (``Flag(cli=False)``).

    Raises:
        TypeError: the field has no description (every flag needs its help text).
    """
    flag = flag_of(field.metadata)
    if not flag.cli:
        return None
    if not field.description:
        raise TypeError(f"options field {name!r} has no description for its --help text")
    spelled = "--" + (flag.name or name).replace("_", "-")
    default = None if field.is_required() else field.default  # a required key may come from a YAML instead
    kwargs: dict[str, Any] = {"help": field.description}
    if _plain(field.annotation) is bool:
        decls = [f"{spelled}/--no-{spelled[2:]}" if default else spelled, name]
        kwargs.update(is_flag=True, default=bool(default), show_default=bool(default))
    else:
        decls = [spelled, name]
        kwargs.update(
            type=_click_type(field, flag),
            default=() if flag.repeat else _default(default),
            multiple=flag.repeat,
            show_default=default is not None and not flag.repeat,
        )
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
    return click.option(*decls, **kwargs)


def model_options(model: type[BaseModel]) -> Callable[[F], F]:
    """A decorator adding one flag per field of ``model`` to a click command, in the model's field order; each
    flag's parameter is named as its field."""

    def decorate(command: F) -> F:
        for name, field in reversed(list(model.model_fields.items())):
            option = option_for(name, field)
            if option is not None:
                command = option(command)
        return command

    return decorate


def given_options(ctx: click.Context, model: type[BaseModel], params: dict[str, Any]) -> dict[str, Any]:
    """The values in ``params`` of ``model``'s fields that the command line gave (not click's defaults), ready for
    ``model(**values)``."""
    return {
        name: (list(params[name]) if isinstance(params[name], tuple) else params[name])
        for name in model.model_fields
        if name in params and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
    }


__all__ = ["given_options", "model_options", "option_for"]
