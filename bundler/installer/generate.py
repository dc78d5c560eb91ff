"""Join the installer's modules into the one file every bundle carries as ``install.py`` (as pip's get-pip.py).

::

    python -m bundler.installer.generate              # rewrite the committed copy (COMMITTED)
    python -m bundler.installer.generate --check      # exit 1 when the committed copy is not a fresh generation
    python -m bundler.installer.generate -o FILE      # write FILE instead (``-`` for stdout)

:func:`render` starts at :data:`ENTRY` (bundler/installer/main.py) and follows its imports of the project depth
first, so that every module comes after the modules it imports: the modules of ferry's foundation that the
installer uses (ferry/errors.py, ...), then the installer's own. Each module goes in as it is written, under a
comment naming its source file and the names it takes from the sections above, minus its import statements:
the standard-library imports of all modules are gathered once at the top, and the project imports are dropped,
because the joined file defines those names itself. ``ferry pack`` writes :func:`render`'s text into every
bundle (bundler/pack.py); the committed copy is there to be read and reviewed, and a test fails when it is stale.

Joining modules into one namespace is sound only when no name means two things, so :func:`render` refuses, with a
:class:`GenerateError` naming the module, the line and the name:

- an import of a module that is neither in the standard library nor one of :data:`FOUNDATION` or the installer's
  own (the file must run with a bare ``python3``);
- a project import it cannot rewrite: ``import ferry.errors``, ``from x import y as z``, a relative import, one
  that is not at the top level of the module, or a name the imported module does not define at its top level;
- a top-level name bound in two modules (defined twice, or defined in one and imported in another), or one that
  shadows a builtin, which the other modules would then see instead;
- an import cycle.

This module is a developer tool, not part of ``install.py``. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

#: The folder holding ``ferry/`` and ``bundler/`` (the source checkout, or site-packages of an installed ferry).
ROOT = Path(__file__).resolve().parents[2]
#: The module whose ``main()`` the joined file runs; everything it imports, directly or not, goes in before it.
ENTRY = "bundler.installer.main"
#: The installer's own package.
INSTALLER = "bundler.installer"
#: The modules outside the installer's package that it may import: ferry's foundation, standard library only.
FOUNDATION = (
    "ferry.errors",
    "ferry.constants",
    "ferry.fsutil",
    "ferry.faults",
    "ferry.serving_tools",
    "bundler.format",
)
#: Top-level packages of the project: an import of one of these is a project import.
PROJECT = ("ferry", "bundler", "trainer", "exporter", "tests", "benchmarks")
#: The generated file kept in the tree (not named ``*.py``: it is not a module of the package).
COMMITTED = Path(__file__).with_name("install.py.generated")
COMMAND = "python -m bundler.installer.generate"
#: Width of the section banners (the project's line length).
WIDTH = 120


class GenerateError(Exception):
    """The installer's modules cannot be joined into one file safely; the message names the module and the line."""


@dataclass
class Module:
    """One source module as the generator sees it."""

    name: str
    path: Path
    root: Path
    source: str
    tree: ast.Module
    #: Project modules it imports, in the order of its import statements.
    imports: list[str] = field(default_factory=list)
    #: The names it takes from each of them.
    takes: dict[str, list[str]] = field(default_factory=dict)
    #: Standard-library import lines (``import os``, ``from pathlib import Path``).
    stdlib: list[str] = field(default_factory=list)
    #: Line ranges (1-based, inclusive) dropped from its text: imports and ``__all__``.
    dropped: list[tuple[int, int]] = field(default_factory=list)
    #: Top-level name -> (what it means, the line binding it).
    bindings: dict[str, tuple[tuple[str, ...], int]] = field(default_factory=dict)

    @property
    def relpath(self) -> str:
        """The source file relative to the project root, POSIX style (``bundler/installer/main.py``)."""
        return self.path.relative_to(self.root).as_posix()


def module_path(name: str, root: Path = ROOT) -> Path:
    """The file of project module ``name`` under ``root`` (``bundler.format`` -> ``ROOT/bundler/format.py``).

    Raises:
        GenerateError: no such file (a package, or a module that does not exist).
    """
    path = root.joinpath(*name.split(".")).with_suffix(".py")
    if not path.is_file():
        raise GenerateError(
            f"cannot resolve the project module {name!r}: no file {path} (import names from a module "
            f"file, not from a package)"
        )
    return path


def _allowed(name: str) -> bool:
    return name in FOUNDATION or (name.startswith(INSTALLER + ".") and name != f"{INSTALLER}.generate")


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PROJECT


def _fail(module: Module, node: ast.AST, why: str) -> GenerateError:
    return GenerateError(f"{module.relpath}:{getattr(node, 'lineno', '?')}: {why}")


def _import_lines(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The standard-library import statements ``node`` makes, one name per line (merged again when rendered)."""
    if isinstance(node, ast.Import):
        return [f"import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names]
    return [f"from {node.module} import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names]


def _import_meaning(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, ...]:
    if isinstance(node, ast.Import):
        return ("module", alias.name if alias.asname else alias.name.split(".")[0])
    return ("from", node.module or "", alias.name)


def parse(name: str, root: Path = ROOT) -> Module:
    """Read and check one module: its imports (sorted into project and standard library) and its top-level names.

    Raises:
        GenerateError: see the module docstring (imports it cannot rewrite, names it cannot bind safely).
    """
    path = module_path(name, root)
    source = path.read_text(encoding="utf-8")
    module = Module(name, path, root, source, ast.parse(source, str(path)))
    body = module.tree.body
    for index, stmt in enumerate(body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            _top_import(module, stmt)
        elif _is_all(stmt):
            module.dropped.append((stmt.lineno, stmt.end_lineno or stmt.lineno))
        elif _is_main_guard(stmt) and (name != ENTRY or index != len(body) - 1):
            raise _fail(
                module,
                stmt,
                f"an `if __name__ == '__main__':` block outside the last statement of the entry module {ENTRY}",
            )
        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    _nested_import(module, node)
            for bound, line in _bound_names(stmt):
                _bind(module, bound, ("defined", name), line)
    for node in ast.walk(module.tree):  # `global x` in a function binds x at the top level
        if isinstance(node, ast.Global):
            for bound in node.names:
                _bind(module, bound, ("defined", name), node.lineno)
    return module


def _top_import(module: Module, node: ast.Import | ast.ImportFrom) -> None:
    module.dropped.append((node.lineno, node.end_lineno or node.lineno))
    if isinstance(node, ast.ImportFrom) and node.level:
        raise _fail(module, node, "a relative import: write `from bundler.installer.NAME import ...`")
    if isinstance(node, ast.ImportFrom) and node.module == "__future__":
        if [a.name for a in node.names] != ["annotations"]:
            raise _fail(module, node, "only `from __future__ import annotations` is supported")
        return
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for target in names:
        if _is_project(target):
            if isinstance(node, ast.Import):
                raise _fail(
                    module,
                    node,
                    f"`import {target}`: the joined file has no module objects; write `from {target} import NAME`",
                )
            if target == INSTALLER:
                raise _fail(
                    module,
                    node,
                    f"`from {INSTALLER} import ...`: import names from the module that "
                    f"defines them (`from {INSTALLER}.MODULE import NAME`)",
                )
            if not _allowed(target):
                raise _fail(
                    module,
                    node,
                    f"imports {target}, which is neither a foundation module "
                    f"({', '.join(FOUNDATION)}) nor part of {INSTALLER}: install.py must run "
                    f"with a bare python3",
                )
            aliased = [f"{a.name} as {a.asname}" for a in node.names if a.asname or a.name == "*"]
            if aliased:
                raise _fail(
                    module,
                    node,
                    f"`from {target} import {', '.join(aliased)}`: import the names as they "
                    f"are defined (the joined file has one namespace)",
                )
            if target not in module.imports:
                module.imports.append(target)
            module.takes.setdefault(target, []).extend(a.name for a in node.names)
            for alias in node.names:
                _bind(module, alias.name, ("import", target, alias.name), node.lineno)
        elif _is_stdlib(target):
            module.stdlib.extend(_import_lines(node))
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                _bind(module, bound, _import_meaning(node, alias), node.lineno)
        else:
            raise _fail(
                module,
                node,
                f"imports {target}, which is not in the standard library: install.py must run with a bare python3",
            )


def _nested_import(module: Module, node: ast.Import | ast.ImportFrom) -> None:
    """An import below the top level: the standard library only (it stays where it is)."""
    targets = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for target in targets:
        if isinstance(node, ast.ImportFrom) and node.level:
            raise _fail(module, node, "a relative import")
        if _is_project(target):
            raise _fail(
                module,
                node,
                f"a project import of {target} below the top level of the module: the "
                f"generator can only drop top-level `from MODULE import NAME` lines",
            )
        if not _is_stdlib(target):
            raise _fail(
                module,
                node,
                f"imports {target}, which is not in the standard library: install.py must run with a bare python3",
            )


def _is_all(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == ["__all__"]


def _is_main_guard(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Compare)
        and isinstance(stmt.test.left, ast.Name)
        and stmt.test.left.id == "__name__"
    )


def _bound_names(stmt: ast.stmt) -> list[tuple[str, int]]:
    """The names a top-level statement binds in the module's namespace (not inside functions, classes, lambdas or
    comprehensions, which have scopes of their own)."""
    if _is_all(stmt):
        return []
    found: list[tuple[str, int]] = []
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node.lineno))
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.append((node.name, node.lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [(a.asname or a.name.split(".")[0], node.lineno) for a in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return found


def _bind(module: Module, name: str, meaning: tuple[str, ...], line: int) -> None:
    if name.startswith("__") and name.endswith("__"):
        raise GenerateError(
            f"{module.relpath}:{line}: binds {name} at the top level, which the joined file would "
            f"share with every other module"
        )
    if name in dir(builtins):
        raise GenerateError(
            f"{module.relpath}:{line}: the top-level name {name!r} shadows the builtin of that name "
            f"for every module after it in the joined file; rename it"
        )
    known = module.bindings.get(name)
    if known is not None and known[0] != meaning:
        raise GenerateError(f"{module.relpath}:{line}: {name!r} is bound twice in this module (line {known[1]})")
    module.bindings.setdefault(name, (meaning, line))


def resolve(entry: str = ENTRY, root: Path = ROOT) -> list[Module]:
    """``entry`` and every project module it imports, directly or not (the files under ``root``), each after the
    modules it imports: the foundation's first, then the installer's.

    Raises:
        GenerateError: an import cycle, or any refusal of :func:`parse`.
    """
    order: list[Module] = []
    done: dict[str, Module] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in path:
            raise GenerateError("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        path.append(name)
        module = parse(name, root)
        for target in module.imports:
            visit(target)
        path.pop()
        done[name] = module
        order.append(module)

    visit(entry)
    # the foundation first (it imports nothing of the installer), then the installer: still each module after
    # the modules it imports, and the joined file reads from the bottom layer up
    return [m for m in order if m.name in FOUNDATION] + [m for m in order if m.name not in FOUNDATION]


def check_names(modules: list[Module]) -> None:
    """Refuse a top-level name that would mean two things in the joined file, or a project import of a name the
    imported module does not define; an imported name means what it means in the module it comes from.

    Raises:
        GenerateError: naming both modules and lines.
    """
    by_name = {m.name: m for m in modules}
    seen: dict[str, tuple[tuple[str, ...], Module, int]] = {}
    for module in modules:  # in import order: what a module imports is resolved already
        for name, (meaning, line) in module.bindings.items():
            if meaning[0] == "import":
                source = by_name[meaning[1]]
                if name not in source.bindings:
                    raise GenerateError(
                        f"{module.relpath}:{line}: imports {name!r} from {meaning[1]}, which defines "
                        f"no top-level {name!r}"
                    )
                meaning = source.bindings[name][0]
                module.bindings[name] = (meaning, line)
            earlier = seen.get(name)
            if earlier is None:
                seen[name] = (meaning, module, line)
            elif earlier[0] != meaning:
                raise GenerateError(
                    f"the top-level name {name!r} means two things in the joined file: {_describe(earlier[0])} "
                    f"({earlier[1].relpath}:{earlier[2]}) and {_describe(meaning)} ({module.relpath}:{line}); "
                    f"define it once and import it, or rename one"
                )


def _describe(meaning: tuple[str, ...]) -> str:
    if meaning[0] == "defined":
        return f"the one defined in {meaning[1]}"
    if meaning[0] == "module":
        return f"the module {meaning[1]}"
    return f"{meaning[2]} from {meaning[1]}"


def _header(modules: list[Module]) -> str:
    sources = "\n".join(f"    {m.relpath}" for m in modules)
    return f'''#!/usr/bin/env python3
"""Verify and install this ferry bundle on the isolated host, with nothing but python3 (>= 3.10).

    cd NAME && python3 install.py --prefix /opt/ferry [--no-venv] [--verify-only]
    python3 install.py --help

GENERATED FILE, DO NOT EDIT. ``ferry pack`` writes it into every bundle. It is ferry's installer
(bundler/installer/) and the parts of ferry it uses, joined in import order by
``{COMMAND}``; each section below names its source file. It imports the standard library
only. Generated from:

{sources}
"""
'''


def _stdlib_block(modules: list[Module]) -> str:
    plain = sorted({line for m in modules for line in m.stdlib if line.startswith("import ")})
    froms: dict[str, set[str]] = {}
    for line in (line for m in modules for line in m.stdlib if line.startswith("from ")):
        source, _, name = line[len("from ") :].partition(" import ")
        froms.setdefault(source, set()).add(name)
    lines = ["from __future__ import annotations", "", *plain]
    for source in sorted(froms):
        lines.append(f"from {source} import {', '.join(sorted(froms[source]))}")
    return "\n".join(lines).rstrip() + "\n"


def _section(module: Module) -> str:
    rule = "# " + "=" * (WIDTH - 2)
    banner = [rule, f"# {module.relpath}"]
    if module.takes:
        uses = "; ".join(
            f"{', '.join(names)} ({module_path(source, module.root).relative_to(module.root).as_posix()})"
            for source, names in module.takes.items()
        )
        banner += textwrap.wrap(
            "Uses, from the sections above: " + uses,
            WIDTH - 2,
            initial_indent="# ",
            subsequent_indent="#   ",
            break_on_hyphens=False,
        )
    banner.append(rule)
    lines = module.source.splitlines()
    drop = {n for start, end in module.dropped for n in range(start, end + 1)}
    kept = [text for n, text in enumerate(lines, 1) if n not in drop and not (n == 1 and text.startswith("#!"))]
    body: list[str] = []
    for text in kept:  # no more than two blank lines in a row where imports were
        if not text.strip() and len(body) >= 2 and not body[-1].strip() and not body[-2].strip():
            continue
        body.append(text)
    return "\n".join(banner) + "\n\n" + "\n".join(body).strip("\n") + "\n"


def render(root: Path = ROOT) -> str:
    """The text of ``install.py``: the header, the standard-library imports, then every module in import order
    (the project's files under ``root``).

    Raises:
        GenerateError: the modules cannot be joined safely (see the module docstring).
    """
    modules = resolve(ENTRY, root)
    check_names(modules)
    text = _header(modules) + "\n" + _stdlib_block(modules) + "\n\n" + "\n\n".join(_section(m) for m in modules)
    compile(text, "install.py", "exec")  # a syntax error here is the generator's own bug
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m bundler.installer.generate [--check] [-o FILE]``; returns the exit status (1: stale or refused)."""
    parser = argparse.ArgumentParser(prog=COMMAND, description="Join the installer's modules into install.py.")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=COMMITTED,
        help=f"where to write it ('-': stdout; default {COMMITTED.relative_to(ROOT)})",
    )
    parser.add_argument("--check", action="store_true", help="only compare the output file with a fresh generation")
    args = parser.parse_args(argv)
    try:
        text = render()
    except GenerateError as exc:
        print(f"generate: error: {exc}", file=sys.stderr)
        return 1
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
        if current != text:
            print(f"generate: {args.output} is not a fresh generation: run {COMMAND}", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    if str(args.output) == "-":
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
