"""The documentation stays true to the code: README.md, docs/*.md and CHANGELOG.md.

- every ``ferry ...`` command line in a fenced code block parses with the real click group (options, sub-commands,
  required arguments and choices; paths need not exist);
- every ``ferry WORD`` named in inline code is a command ferry has;
- every relative link ``[text](path)`` or ``[text](path#anchor)`` reaches a file, and the anchor a heading of it;
- the README stays short and is the index of every page under docs/;
- no tracked file mentions the project's own issues by number (users never see them).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from ferry.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
COMMAND_FILES = [README, *DOCS]
LINK_FILES = [README, *DOCS, CHANGELOG]
README_MAX_LINES = 200

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
# `ferry ARGS`, also written `$ ferry ARGS` or `.venv/bin/ferry ARGS` (any path ending in .venv/bin/)
COMMAND = re.compile(r"^(?:\$\s+)?(?:\S*\.venv/bin/)?ferry\s+(?P<args>.*)$")
SHELL_OPERATORS = set("();<>|&")
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<title>.*?)\s*#*\s*$")
ISSUE_MENTION = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    fence = ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if match and (not fence or match.group(1).startswith(fence)):
            fence = "" if fence else match.group(1)
            continue
        if not fence:
            yield number, line


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for every line inside fenced code blocks."""
    outside = {number for number, _ in prose_lines(text)}
    for number, line in enumerate(text.splitlines(), start=1):
        if number not in outside and not FENCE.match(line):
            yield number, line


def command_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, arguments after ``ferry``) for each ferry command in a fenced block, ``\\`` lines joined."""
    lines = list(code_lines(text))
    index = 0
    while index < len(lines):
        number, line = lines[index]
        joined = line.strip()
        while joined.endswith("\\") and index + 1 < len(lines):
            index += 1
            joined = joined[:-1] + " " + lines[index][1].strip()
        match = COMMAND.match(joined)
        if match:
            yield number, match.group("args")
        index += 1


def split_arguments(args: str) -> list[str]:
    """Shell words of ``args``, a trailing ``# comment`` dropped, cut at the first pipe, ``;``, ``&&`` or redirect."""
    lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if set(word) <= SHELL_OPERATORS:
            break
        words.append(word)
    return words


def parse_with_cli(words: list[str]) -> None:
    """Resolve ``ferry WORDS`` through the click group, calling make_context at every level (as click's own
    invocation does), so an unknown option, sub-command or choice, or a missing argument, raises."""
    command: click.Command = cli
    name = "ferry"
    parent = None
    while True:
        try:
            ctx = command.make_context(name, list(words), parent=parent)
        except click.exceptions.Exit as done:  # --help, --version, ferry train --keys: eager options that exit
            if done.exit_code:
                raise click.UsageError(f"exits with {done.exit_code}") from done
            return
        if not isinstance(command, click.Group):
            return
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            raise click.UsageError("no sub-command")
        name, found, words = command.resolve_command(ctx, rest)
        if found is None:
            raise click.UsageError(f"no such command {name!r}")
        command, parent = found, ctx


def test_every_ferry_command_line_in_the_docs_parses(monkeypatch):
    # the docs name paths on the user's machines: check the words, not the file system
    monkeypatch.setattr(click.Path, "convert", lambda self, value, param, ctx: value)
    checked = 0
    failures = []
    for path in COMMAND_FILES:
        for number, args in command_lines(path.read_text(encoding="utf-8")):
            checked += 1
            try:
                parse_with_cli(split_arguments(args))
            except (click.ClickException, ValueError) as exc:
                message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
                failures.append(f"{rel(path)}:{number}: ferry {args}\n    {message}")
    assert not failures, "command lines the CLI refuses:\n" + "\n".join(failures)
    assert checked >= 20, f"only {checked} ferry command lines found: is the fence or prefix rule broken?"


def github_slug(title: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation other than - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeated titles."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group("title"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every relative link or image outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group("target").strip("<>")
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ...
                yield number, target


def link_problem(source: Path, target: str) -> str | None:
    """Why ``target`` (as written in ``source``) does not resolve, or None."""
    file_part, _, anchor = target.partition("#")
    resolved = (source.parent / file_part).resolve() if file_part else source
    if not resolved.exists():
        return f"{file_part} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{rel(resolved)} has no heading with the anchor #{anchor}"
    return None


#: ``ferry WORD`` in inline code: a command named in running text
INLINE_COMMAND = re.compile(r"`ferry ([a-z][a-z0-9-]*)")


def test_every_ferry_command_named_in_running_text_exists():
    named = {
        (path.name, match.group(1))
        for path in COMMAND_FILES
        for match in INLINE_COMMAND.finditer(path.read_text(encoding="utf-8"))
    }
    assert len(named) > 20  # the pattern still finds what the pages name
    commands = cli.load_all()
    unknown = sorted((page, word) for page, word in named if word not in commands)
    assert not unknown, f"commands named in the docs that ferry does not have: {unknown}"


def test_every_command_module_is_named_in_the_lazy_table_and_a_command_imports_only_its_own():
    """ferry.cli.COMMAND_MODULES names every command of every ``ferry/cli/*.py`` module's COMMANDS (a command left
    out would be missing from ferry), and running one command's help imports its module alone."""
    import ast
    import subprocess
    import sys

    from ferry.cli import COMMAND_MODULES

    defined = {}
    for path in sorted((ROOT / "ferry" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "command" and node.args:
                if isinstance(node.args[0], ast.Constant):
                    defined[node.args[0].value] = path.stem
    assert defined == COMMAND_MODULES
    code = (
        "import sys; from ferry.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('ferry.cli.', 'bundler', 'trainer', 'evaluation'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.splitlines()[-1] == "['ferry.cli.serve']"


def test_every_relative_link_in_the_docs_resolves():
    failures = []
    for path in LINK_FILES:
        assert path.exists(), f"{rel(path)} is missing"
        for number, target in relative_links(path):
            problem = link_problem(path, target)
            if problem:
                failures.append(f"{rel(path)}:{number}: ({target}) {problem}")
    assert not failures, "broken links:\n" + "\n".join(failures)


def test_the_readme_is_short_and_links_every_docs_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in relative_links(README)}
    unlinked = [rel(page) for page in DOCS if page.resolve() not in linked]
    assert DOCS, "docs/ holds no page"
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def tracked_files() -> list[Path]:
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    return [ROOT / name for name in listing.decode().split("\0") if name]


def issue_mentions(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line of a text file that names an issue by number."""
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but deleted in the work tree
        return
    if b"\0" in data:
        return
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if ISSUE_MENTION.search(line):
            yield number, line.strip()


def test_the_mention_rule_matches_the_ways_issues_are_written(tmp_path):
    sample = tmp_path / "sample.py"
    words = ["issue", "Issue", "ISSUES", "issue #", "(issue ", "issues "]
    sample.write_text("\n".join(f"x  # {word}{n}" for n, word in enumerate(words, start=2)) + "\ntissue 5\n")
    assert [number for number, _ in issue_mentions(sample)] == list(range(1, len(words) + 1))


def test_no_tracked_file_mentions_the_projects_issues_by_number():
    found = [f"{rel(path)}:{number}: {line}" for path in tracked_files() for number, line in issue_mentions(path)]
    assert not found, f"{len(found)} mentions of the project's issues (users never see them):\n" + "\n".join(found)
