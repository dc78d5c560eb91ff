"""The shared pieces: the error family through the CLI, crash-safe writes, sizes, offline model lookup, demo
assets."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferry import constants, fsutil, hub
from ferry.errors import (
    ConfigError,
    FerryError,
    InsufficientSpaceError,
    NotInstalledError,
)


def test_every_error_is_a_ferry_error_with_a_distinct_exit_code():
    from ferry import errors

    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(c, FerryError) for c in classes)
    codes = [c.exit_code for c in classes]
    assert len(set(codes)) == len(codes)
    assert issubclass(ConfigError, ValueError) and issubclass(InsufficientSpaceError, OSError)


def test_cli_turns_a_ferry_error_into_one_line_and_its_exit_code(tmp_path):
    script = (
        "import click\n"
        "from ferry import cli\n"
        "from ferry.errors import ConfigError\n"
        "@cli.cli.command('boom')\n"
        "def boom():\n"
        "    raise ConfigError(\"unknown key 'lora_rnak' in cfg.yaml (did you mean 'lora_rank'?)\")\n"
        "cli.main(['boom'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == ConfigError.exit_code
    assert proc.stderr.strip().splitlines() == [
        "ferry: error: unknown key 'lora_rnak' in cfg.yaml (did you mean 'lora_rank'?)"
    ]


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "a.json"
    fsutil.atomic_write_text(target, "one")
    fsutil.atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"]


def test_atomic_writes_get_the_bits_open_and_mkdir_give_under_the_umask(tmp_path):
    # a service account reads what ferry writes under umask 022; umask 077 keeps it to the owner; the temp file
    # and folder alone would be 0600 / 0700 whatever the umask
    import os
    import stat

    def bits(path):
        return stat.S_IMODE(path.stat().st_mode)

    before = os.umask(0o022)
    try:
        for mask, file_bits, dir_bits in ((0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)):
            os.umask(mask)
            assert fsutil.process_umask() == mask
            work = tmp_path / f"mask-{mask:03o}"
            fsutil.atomic_write_text(work / "SERVING.md", "text")
            with fsutil.atomic_directory(work / "merged") as tmp:
                (tmp / "config.json").write_text("{}")
            with fsutil.atomic_directory(work / "adapter", same_name=True) as tmp:
                (tmp / "f").write_text("x")
            assert bits(work / "SERVING.md") == file_bits and (work / "SERVING.md").read_text() == "text"
            assert bits(work / "merged") == bits(work / "adapter") == dir_bits
        os.umask(0o022)
        fsutil.atomic_write_text(tmp_path / "explicit", "x", mode=0o600)  # an explicit mode wins
        assert bits(tmp_path / "explicit") == 0o600
    finally:
        os.umask(before)


def test_atomic_directory_keeps_the_old_one_on_failure(tmp_path):
    target = tmp_path / "out"
    with fsutil.atomic_directory(target) as tmp:
        (tmp / "f").write_text("old")
    with pytest.raises(RuntimeError):
        with fsutil.atomic_directory(target, overwrite=True) as tmp:
            (tmp / "f").write_text("new")
            raise RuntimeError("killed half-way")
    assert (target / "f").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with fsutil.atomic_directory(target, overwrite=True) as tmp:
        (tmp / "f").write_text("new")
    assert (target / "f").read_text() == "new"
    with pytest.raises(FileExistsError):
        with fsutil.atomic_directory(target):
            pass


def test_free_space_check_names_need_and_place(tmp_path):
    with pytest.raises(InsufficientSpaceError, match=str(tmp_path)) as info:
        fsutil.ensure_free_space(tmp_path / "not" / "yet", 1 << 60, what="extracting the bundle")
    assert str(info.value).startswith("extracting the bundle needs 1048576.0 TiB in ")
    assert "is free" in str(info.value)
    fsutil.ensure_free_space(tmp_path, 1)


def _write_each_onto_a_full_disk(disk: Path) -> None:
    """In the mount namespace where ``disk`` is a 256 KiB tmpfs: 1 MiB written by Python, by ``torch.save``
    (:func:`trainer.checkpoint.save_torch`) and by safetensors' Rust writer; for each, the one line of
    :func:`ferry.fsutil.host_write_error` (the partial file removed after it)."""
    import torch
    from safetensors.torch import save_file

    from trainer.checkpoint import save_torch

    writers = {
        "python": lambda path: fsutil.atomic_write_bytes(path, b"\0" * (1 << 20)),
        "torch": lambda path: save_torch({"w": torch.zeros(1 << 18)}, path),
        "safetensors": lambda path: save_file({"w": torch.zeros(1 << 18)}, str(path)),
    }
    for name, write in writers.items():
        try:
            write(disk / name)
        except Exception as exc:  # noqa: BLE001 - each writer's own kind of error, turned into the line or None
            print(fsutil.host_write_error(exc, f"the {name} file", disk))
        (disk / name).unlink(missing_ok=True)


def test_a_full_disk_is_one_line_whichever_writer_ran_into_it(tmp_path):
    """torch's zip writer turns ENOSPC into a ``RuntimeError`` ("unexpected pos ...") and safetensors into a
    ``SafetensorError`` ("... (os error 28)"): both still give the one line, torch's naming its file."""
    from tests.support.helpers import fork_ferry

    disk = tmp_path / "disk"
    disk.mkdir()
    proc = fork_ferry(
        [],
        env=dict(os.environ),
        cwd=tmp_path,
        mount_setup=f"mount -t tmpfs -o size=256k tmpfs {disk}",
        entry=lambda _: _write_each_onto_a_full_disk(disk),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(zip(("python", "torch", "safetensors"), proc.stdout.splitlines()))
    for name, where in (("python", f" ({disk}/python)"), ("torch", f" ({disk}/torch)"), ("safetensors", "")):
        said = f"cannot write the {name} file: No space left on device{where}; "
        assert re.fullmatch(re.escape(said) + r"\d+(\.\d)? (B|KiB) free in " + re.escape(str(disk)), lines[name]), lines
    assert fsutil.host_write_error(RuntimeError("unexpected pos 704 vs 598"), "x", disk) is None
    assert fsutil.host_write_error(PermissionError(13, "Permission denied", "/y"), "x", disk) == (
        "cannot write x: Permission denied (/y)"
    )


def test_a_write_the_host_refuses_past_a_command_is_one_line(tmp_path, stories_model):
    """A command that meets a full disk or a read-only folder where it has no message of its own (``ferry inspect
    --html`` here) still ends in one line naming the file (with the free space when the disk is full) and an exit
    code, not a traceback; any other ``OSError`` keeps its traceback (a bug)."""
    from bundler.pack import pack
    from bundler.spec import load_spec
    from tests.support.helpers import fork_ferry

    pack(load_spec(name="b", models=[str(stories_model)], no_wheels=True), tmp_path / "out", progress=False)
    bundle = str(tmp_path / "out" / "b.ferry.tar")
    disk, locked = tmp_path / "disk", tmp_path / "locked"
    disk.mkdir(), locked.mkdir()
    setup = (
        f"mount -t tmpfs -o size=64k tmpfs {disk} && (head -c 100000 /dev/zero > {disk}/filler; true) && "
        f"mount -o bind,ro {locked} {locked}"
    )
    said = {}
    for where in (disk, locked):
        args = ["inspect", bundle, "--html", str(where / "review.html")]
        proc = fork_ferry(args, env=dict(os.environ), cwd=tmp_path, mount_setup=setup)
        said[where.name] = (proc.returncode, proc.stderr.strip().splitlines())
    assert said["disk"] == (
        InsufficientSpaceError.exit_code,
        [
            f"ferry: error: cannot write {disk}/review.html: No space left on device; 0 B free in {disk}; make room "
            "and run the command again"
        ],
    ), said
    assert said["locked"] == (
        FerryError.exit_code,
        [
            f"ferry: error: cannot write {locked}/review.html: Read-only file system; choose a folder this account "
            "can write and run the command again"
        ],
    ), said
    from ferry.cli import _host_write_line

    assert _host_write_line(FileNotFoundError(2, "No such file or directory", "/nowhere/x")) is None


@pytest.mark.parametrize(
    "text,expected",
    [("5GB", 5 * 10**9), ("4G", 4 * 10**9), ("500MiB", 500 * 2**20), ("1024", 1024), (" 1.5 kb", 1500), (7, 7)],
)
def test_parse_size(text, expected):
    assert fsutil.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        fsutil.parse_size(text)


def test_apply_offline_env_forces_offline_switches_but_keeps_user_choices():
    env = {"HF_HUB_OFFLINE": "0", "WANDB_MODE": "offline"}
    constants.apply_offline_env(env)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["WANDB_MODE"] == "offline"
    assert env["DO_NOT_TRACK"] == "1"


def test_resolve_model_finds_a_path_and_explains_a_missing_repo(tmp_path, monkeypatch, stories_model):
    assert hub.resolve_model(stories_model) == stories_model.resolve()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(NotInstalledError, match=r"add 'hf:acme/missing-model'.*ferry pack"):
        hub.resolve_model("acme/missing-model")


def test_resolve_model_reads_the_hf_cache_layout(tmp_path, monkeypatch, stories_model):
    """A snapshot placed in the HF cache layout (as ferry install does) is found by repo id and revision."""
    commit = "a" * 40
    repo = tmp_path / "hf-home" / "hub" / "models--acme--stories"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in stories_model.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub.resolve_model("acme/stories") == snap
    assert hub.resolve_model("hf:acme/stories@" + commit) == snap


def test_resolve_model_finds_a_modelscope_install(tmp_path, monkeypatch, stories_model):
    """ferry install places ms: models at MODELSCOPE_CACHE/models/ORG/NAME with '.' written '___'."""
    import shutil

    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    target = tmp_path / "ms" / "models" / "karpathy" / "stories___260K"
    shutil.copytree(stories_model, target)
    assert hub.resolve_model("ms:karpathy/stories.260K") == target


def test_demo_model_is_deterministic_and_loads(tmp_path):
    from ferry.cli.demo_assets import DEMO_VOCAB_SIZE, build_demo_model

    a = build_demo_model(tmp_path / "a")
    b = build_demo_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert tok.pad_token_id == 3 and tok.eos_token_id == 2
    assert model.config.vocab_size == DEMO_VOCAB_SIZE
    assert tok.decode(tok("Spell the word backwards.").input_ids) == "Spell the word backwards."


#: The packages from the bottom up: a module may import its own layer and the layers below it, never one above,
#: at module level or lazily inside a function.
LAYERS = ("foundation", "bundler", "trainer", "serving", "exporter", "evaluation", "cli")


def _layer(module: str) -> str:
    top = module.split(".")[0]
    if top == "ferry":
        return "cli" if module.startswith("ferry.cli") or module == "ferry.__main__" else "foundation"
    return top


def _import_graph(root: Path | None = None) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its code (lazy imports in functions included)."""
    import ast

    root = root or Path(__file__).resolve().parents[1]
    modules = {}
    for package in ("ferry", "bundler", "trainer", "serving", "exporter", "evaluation"):
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module mod; `from mod import name` imports mod
                candidates = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c != name)
        graph[name] = targets
    return graph


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every import of a higher layer than the importer's (:data:`LAYERS`)."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(
        f"{m} ({_layer(m)}) -> {t} ({_layer(t)})"
        for m, targets in graph.items()
        for t in targets
        if rank[_layer(t)] > rank[_layer(m)]
    )


def test_imports_follow_the_layers_lazy_imports_included():
    """foundation < bundler < trainer < serving < exporter < evaluation < ferry.cli: no module imports a layer above
    its own, not even inside a function (the trainer and the exporter share the adapter folder through
    ferry.adapter_folder, never through each other)."""
    assert _upward_imports(_import_graph()) == []


def test_the_layer_rule_sees_a_lazy_upward_import(tmp_path):
    """The rule catches what it exists for: an import of the exporter inside a trainer function."""
    for package, text in {
        "ferry": "",
        "trainer": "def f():\n    from exporter.stack import adapter_folder\n",
        "exporter": "",
    }.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / ("lf_compat.py" if package == "trainer" else "stack.py")).write_text(text)
    assert _upward_imports(_import_graph(tmp_path)) == ["trainer.lf_compat (trainer) -> exporter.stack (exporter)"]


def test_the_adapter_folder_contract_needs_only_the_standard_library():
    """ferry.adapter_folder imports the standard library and ferry's foundation only, in a fresh interpreter."""
    code = (
        "import sys; before = set(sys.modules); import ferry.adapter_folder; "
        "extra = {m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names); "
        "print(sorted(extra))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "['ferry']"


def test_imports_make_no_circle():
    """No two modules import each other, directly or round a longer circle."""
    graph = _import_graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph[module]):
            if seen.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(target) :] + [target]))
            if target not in seen:
                visit(target, path + [target])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
