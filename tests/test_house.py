"""The house rules a reader relies on, checked on the source: functions short enough to read in one screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Packages whose functions stay within :data:`MAX_LINES` lines unless a reason is written next to them.
SHORT_FUNCTION_PACKAGES = ("trainer", "serving", "exporter", "evaluation", "bundler", "ferry")
MAX_LINES = 80
#: The marker of a written reason: a comment line directly above the ``def`` (above its decorators), e.g.
#: ``# long: one pass over the shards; splitting it would pass six buffers between helpers``.
REASON = "# long:"


def long_functions(root: Path = ROOT) -> list[str]:
    """``path:line name (N lines)`` for each function over :data:`MAX_LINES` lines (``def`` to its last line,
    docstring included) without a :data:`REASON` comment above it."""
    found = []
    for package in SHORT_FUNCTION_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                above = lines[first - 2].strip() if first >= 2 else ""
                if length > MAX_LINES and not above.startswith(REASON):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_functions_are_short_or_say_why():
    assert long_functions() == []


def test_the_length_rule_sees_a_long_function_and_reads_its_reason(tmp_path):
    (tmp_path / "trainer").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "trainer" / "m.py").write_text(
        f"def long_one():\n{body}\n\n{REASON} kept whole on purpose\n"
        f"def explained():\n{body}\n\ndef short():\n    return 1\n"
    )
    assert long_functions(tmp_path) == [f"trainer/m.py:1 long_one ({MAX_LINES + 1} lines)"]
