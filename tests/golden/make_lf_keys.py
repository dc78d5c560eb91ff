"""Read LLaMA-Factory's own argument dataclasses: every key its parsers take, with its default, by command.

The source is LLaMA-Factory 0.9.5's sdist from the package index (``tests.support.pinned_sdist.LLAMAFACTORY``,
hash-pinned), read as source (``ast``): nothing of it is imported, so it needs neither its dependencies nor a venv of
its own. Each dataclass of
``llamafactory/hparams/*.py`` gives its fields in order, its bases' first (as ``dataclasses`` orders them), each with
its default when that is a literal (``None`` for a ``default_factory`` or an expression, with ``"literal": false``).
Fields declared ``field(init=False)`` (``model_max_length``, ``compute_dtype``, ...) are no keys: transformers'
``HfArgumentParser`` skips them, so LLaMA-Factory refuses them in a YAML; the table leaves them out.
The parsers' argument lists (``_TRAIN_ARGS``, ``_INFER_ARGS``, ``_EVAL_ARGS`` in ``hparams/parser.py``) say which
dataclasses each command reads; the training list's ``TrainingArguments`` is LLaMA-Factory's subclass of
transformers' (only its own fields are listed: transformers' are ferry's ``TrainingArguments`` keys already).

Run (network on first use)::

    .venv/bin/python -m tests.golden.make_lf_keys > ferry/lf_keys.json
    .venv/bin/python -m tests.golden.make_lf_keys --page > docs/llamafactory-keys.md   # the table as a page

``ferry/lf_keys.json`` is this output; tests/test_lf_keys.py checks that it still is.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

#: The release the table is read from (tests.support.pinned_sdist.LLAMAFACTORY).
VERSION = "0.9.5"


def _default(value: ast.expr | None) -> tuple[Any, bool]:
    """A field's default from its assigned value (``field(default=...)`` or a plain value): (value, literal?)."""
    if value is None:
        return None, False
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                value = kw.value
                break
        else:
            return None, False  # default_factory, or no default (a required field)
    try:
        return ast.literal_eval(value), True
    except ValueError:
        return None, False


def _not_init(value: ast.expr | None) -> bool:
    """Whether a field is declared ``field(..., init=False)``: set after parsing, never read from a YAML."""
    return (
        isinstance(value, ast.Call)
        and getattr(value.func, "id", None) == "field"
        and any(
            kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False for kw in value.keywords
        )
    )


def read_dataclasses(hparams: Path) -> dict[str, dict[str, Any]]:
    """``{class name: {"bases": [...], "fields": {name: {"default": ..., "literal": bool}}}}`` of every class in
    the folder ``hparams`` (``src/llamafactory/hparams``), and the parsers' lists (``{"list": [class names]}``)."""
    classes: dict[str, dict[str, Any]] = {}
    for path in sorted(hparams.glob("*.py")):
        name = path.name
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            fields: dict[str, Any] = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if _not_init(item.value):
                        continue
                    default, literal = _default(item.value)
                    fields[item.target.id] = {"default": default, "literal": literal}
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            classes[node.name] = {"bases": bases, "fields": fields}
        if name.endswith("parser.py"):
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                    target = node.targets[0].id
                    if target in ("_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS") and isinstance(node.value, ast.List):
                        classes[target] = {"list": [ast.unparse(e) for e in node.value.elts]}
    return classes


def _all_fields(classes: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """A dataclass's fields with its bases' (the last base's first, as dataclasses collects them)."""
    info = classes.get(name)
    if info is None or "fields" not in info:
        return {}
    out: dict[str, Any] = {}
    for base in reversed(info["bases"]):
        out.update(_all_fields(classes, base))
    out.update(info["fields"])
    return out


def lf_keys(sdist: Path) -> dict[str, Any]:
    """The table of the unpacked sdist ``sdist``: LLaMA-Factory's version, and per command (``train``, ``infer`` for
    chat and export, ``eval``) every key with its default and the dataclass that declares it."""
    classes = read_dataclasses(sdist / "src" / "llamafactory" / "hparams")
    commands: dict[str, dict[str, Any]] = {}
    for command, listed in (("train", "_TRAIN_ARGS"), ("infer", "_INFER_ARGS"), ("eval", "_EVAL_ARGS")):
        keys: dict[str, Any] = {}
        for cls in classes[listed]["list"]:
            for key, spec in _all_fields(classes, cls).items():
                keys.setdefault(key, {**spec, "class": cls})
        commands[command] = dict(sorted(keys.items()))
    return {"llamafactory": VERSION, "commands": commands}


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1, sort_keys=False, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    from tests.support.pinned_sdist import LLAMAFACTORY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", action="store_true", help="write docs/llamafactory-keys.md's text instead")
    if parser.parse_args(argv).page:
        from trainer.config import TrainConfig
        from trainer.lf_compat import lf_keys_page

        sys.stdout.write(lf_keys_page(TrainConfig.model_fields))
        return 0
    sys.stdout.write(render(lf_keys(LLAMAFACTORY.path())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
