"""The bundle's ``install.py`` is generated: bundler/installer/ and the foundation modules it imports, joined into
one file by bundler/installer/generate.py.

- The committed copy (bundler/installer/install.py.generated) and the install.py of a freshly packed bundle are
  each a fresh generation.
- It runs with a bare python3 and nothing else importable (``-I -S``, alone in an empty folder, no network), and
  imports nothing outside the standard library; the errors, ``OFFLINE_ENV``, format constants and tool pins in
  it are ferry's own.
- A bundle packed before the installer was generated (fixtures/prechange.ferry.tar.xz, whose install.py is the
  hand-written one) installs with it, and a bundle packed now installs with a bare python3 in a network namespace.
- Every installer module and the foundation modules it joins import only the standard library, the foundation and
  each other; the generated file binds each top-level name once; the generator refuses what it cannot join
  safely (a name meaning two things, an import it cannot rewrite, a cycle).
"""

from __future__ import annotations

import ast
import hashlib
import json
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import bundler.format as fmt
import ferry.errors
from bundler.installer import generate
from bundler.installer.generate import COMMAND, COMMITTED, FOUNDATION, GenerateError, render
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify_prefix
from ferry.constants import OFFLINE_ENV
from ferry.serving_tools import TOOL_FILES
from tests.support.helpers import ROOT
from tests.support.netns import run_offline

FIXTURES = Path(__file__).with_name("fixtures")
#: A python3 with nothing but the standard library: isolated (no environment, no user site, no script folder on
#: sys.path) and without the site module.
BARE = ["/usr/bin/python3", "-I", "-S"]


@pytest.fixture(scope="module")
def generated() -> str:
    return render()


@pytest.fixture(scope="module")
def bare_installer(tmp_path_factory: pytest.TempPathFactory, generated: str) -> Path:
    """The generated install.py alone in an empty folder."""
    folder = tmp_path_factory.mktemp("bare-installer")
    (folder / "install.py").write_text(generated, encoding="utf-8")
    return folder / "install.py"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> dict:
    """A bundle packed now (the stories260K model and the alpaca demo data, no wheels), signed by a throw-away key:
    ``{"out", "dir", "tar", "allowed"}``."""
    root = tmp_path_factory.mktemp("packed-now")
    key = root / "packer"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "packer@now", "-f", str(key)], check=True)
    allowed = root / "allowed_signers"
    allowed.write_text(f'packer@now namespaces="ferry-bundle" {(root / "packer.pub").read_text().strip()}\n')
    spec = load_spec(
        name="now",
        models=[str(stories_model)],
        datasets=[str(llamafactory_data / "alpaca_en_demo.json")],
        no_wheels=True,
    )
    pack(spec, root / "out", progress=False, sign=key)
    return {"out": root / "out", "dir": root / "out" / "now", "tar": root / "out" / "now.ferry.tar", "allowed": allowed}


def _bare_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home)}


# ------------------------------------------------------------------------------------------ a fresh generation


def test_the_committed_install_py_is_a_fresh_generation(generated: str, tmp_path: Path) -> None:
    assert COMMITTED.read_text(encoding="utf-8") == generated, f"stale: run {COMMAND}"
    assert generate.main(["--check"]) == 0
    stale = tmp_path / "install.py"
    stale.write_text(generated.replace("GENERATED FILE", "EDITED FILE"))
    assert generate.main(["--check", "--output", str(stale)]) == 1


def test_a_freshly_packed_bundle_carries_a_fresh_generation(packed: dict, generated: str) -> None:
    manifest = json.loads((packed["dir"] / "manifest.json").read_text())
    entry = next(e for e in manifest["support_files"] if e["path"] == fmt.INSTALLER_NAME)
    assert entry["sha256"] == hashlib.sha256(generated.encode()).hexdigest()
    assert (packed["dir"] / fmt.INSTALLER_NAME).read_text(encoding="utf-8") == generated
    with tarfile.open(packed["tar"]) as tar:
        member = tar.extractfile(f"now/{fmt.INSTALLER_NAME}")
        assert member is not None and member.read().decode() == generated
    assert manifest["format_version"] == fmt.FULL_FORMAT_VERSION == 1  # the bundle format did not change


def test_the_generated_file_names_its_sources_and_marks_each_one(generated: str) -> None:
    header = ast.get_docstring(ast.parse(generated)) or ""
    assert "GENERATED FILE, DO NOT EDIT" in header and COMMAND in header
    sources = [m.relpath for m in generate.resolve()]
    assert set(sources[: len(FOUNDATION)]) == {f"{m.replace('.', '/')}.py" for m in FOUNDATION}  # the bottom layer
    for source in sources:
        assert f"    {source}" in header.splitlines()
        assert f"\n# {source}\n" in generated, source
    assert sources[-1] == "bundler/installer/main.py" and generated.rstrip().endswith("sys.exit(main())")


# ------------------------------------------------------------------------------------ a bare python3, offline


def test_install_py_runs_with_a_bare_python_and_imports_only_the_standard_library(bare_installer: Path) -> None:
    """Loaded with ferry and bundler made unimportable, install.py imports nothing outside the standard library,
    and what it defines is ferry's own: the error family (names, bases, exit codes), OFFLINE_ENV, the format
    constants, the tool pins."""
    helptext = subprocess.run(
        [*BARE, str(bare_installer), "--help"],
        capture_output=True,
        text=True,
        cwd=bare_installer.parent,
        env=_bare_env(bare_installer.parent),
        check=True,
    )
    assert helptext.stdout.startswith("usage: install.py")
    for flag in (
        "--prefix",
        "--no-venv",
        "--verify-only",
        "--verify-prefix",
        "--allowed-signers",
        "--require-signature",
        "--private",
        "--replace-datasets",
        "--manifest",
        "--state",
    ):
        assert flag in helptext.stdout, flag
    errors = list(ferry.errors.__all__)
    constants = [
        "FORMAT_VERSION",
        "FULL_FORMAT_VERSION",
        "MANIFEST_NAME",
        "SUMS_NAME",
        "INSTALLER_NAME",
        "LOCK_NAME",
        "ARCHIVE_SUFFIX",
        "VOLUMES_SUMS_SUFFIX",
        "VOLUME_DIGITS",
        "DATASETS_CACHE_DIRNAME",
        "DELTAS_DIRNAME",
        "WHEEL_STORE_DIRNAME",
        "STATE_FORMAT",
        "SIGNATURE_NAME",
        "SIGNATURE_SUFFIX",
        "SBOM_NAME",
        "SIGNATURE_NAMESPACE",
        "POLICY_NAME",
    ]
    code = (
        "import json, runpy, sys\n"
        "for name in ('ferry', 'bundler'):\n"
        "    sys.modules[name] = None  # an import of either would fail\n"
        "ns = runpy.run_path('install.py', run_name='install')\n"
        "outside = sorted(m for m, mod in sys.modules.items() if mod is not None and m != '__main__'\n"
        "                 and m.split('.')[0] not in sys.stdlib_module_names)\n"
        f"errors = {{n: [ns[n].exit_code, [b.__name__ for b in ns[n].__mro__], ns[n].__module__]\n"
        f"          for n in {errors!r}}}\n"
        f"constants = {{n: ns[n] for n in {constants!r}}}\n"
        "print(json.dumps({'outside': outside, 'errors': errors, 'constants': constants,\n"
        "                  'offline': ns['OFFLINE_ENV'], 'tools': ns['TOOL_FILES']}))\n"
    )
    proc = subprocess.run(
        [*BARE, "-c", code],
        capture_output=True,
        text=True,
        cwd=bare_installer.parent,
        env=_bare_env(bare_installer.parent),
        check=True,
    )
    found = json.loads(proc.stdout)
    assert found["outside"] == []
    for name, (exit_code, mro, module) in found["errors"].items():
        canonical = getattr(ferry.errors, name)
        assert exit_code == canonical.exit_code and mro == [b.__name__ for b in canonical.__mro__], name
        assert module == "install"  # defined in install.py itself: no ferry was imported
    assert found["constants"] == {n: getattr(fmt, n) for n in constants}
    assert found["offline"] == OFFLINE_ENV and found["tools"] == TOOL_FILES


def test_a_bundle_packed_now_installs_with_a_bare_python_offline(
    packed: dict, bare_installer: Path, tmp_path: Path
) -> None:
    env, cwd = _bare_env(tmp_path), bare_installer.parent
    checked = run_offline(
        [
            *BARE,
            str(bare_installer),
            "--bundle",
            str(packed["tar"]),
            "--verify-only",
            "--allowed-signers",
            str(packed["allowed"]),
        ],
        env=env,
        cwd=cwd,
    )
    assert "signature: good, by packer@now" in checked.stdout and checked.stdout.splitlines()[-1].startswith("OK: ")
    prefix = tmp_path / "prefix"
    done = run_offline(
        [
            *BARE,
            str(bare_installer),
            "--bundle",
            str(packed["tar"]),
            "--prefix",
            str(prefix),
            "--allowed-signers",
            str(packed["allowed"]),
        ],
        env=env,
        cwd=cwd,
    )
    assert "model   local/stories260K @ " in done.stdout and "dataset alpaca_en_demo -> " in done.stdout
    assert done.stdout.splitlines()[-1].endswith(f" files verified; now run: source {prefix / 'ferry.env'}")
    again = run_offline([*BARE, str(bare_installer), "--verify-prefix", str(prefix)], env=env, cwd=cwd)
    assert again.stdout.startswith("OK: 1 bundle(s), ")
    refused = run_offline(
        [
            *BARE,
            str(bare_installer),
            "--bundle",
            str(packed["dir"]),
            "--prefix",
            str(tmp_path / "other"),
            "--require-signature",
        ],
        env=env,
        cwd=cwd,
        check=False,
    )
    assert refused.returncode == ferry.errors.BundleError.exit_code
    assert refused.stderr.strip().splitlines()[-1].startswith("install.py: error: --require-signature")


def test_a_bundle_packed_before_the_generated_installer_installs_with_it(bare_installer: Path, tmp_path: Path) -> None:
    """fixtures/prechange.ferry.tar.xz was packed by the hand-written installer (make_prechange_bundle.py): a
    local model (config.json, model.safetensors) and a local dataset, signed. Today's generated install.py
    verifies and installs it with a bare python3 and no network, and ferry reads the prefix it wrote."""
    archive = tmp_path / "prechange.ferry.tar"
    archive.write_bytes(lzma.decompress((FIXTURES / "prechange.ferry.tar.xz").read_bytes()))
    allowed = FIXTURES / "prechange.allowed_signers"
    with tarfile.open(archive) as tar:
        old = tar.extractfile("prechange/install.py").read().decode()  # type: ignore[union-attr]
        manifest = json.loads(tar.extractfile("prechange/manifest.json").read())  # type: ignore[union-attr]
        config = tar.extractfile("prechange/models/local/tiny-model/config.json").read()  # type: ignore[union-attr]
    assert "FALLBACK_OFFLINE_ENV" in old and "GENERATED FILE" not in old  # really the old, hand-written installer
    assert manifest["format_version"] == fmt.FULL_FORMAT_VERSION
    env, cwd = _bare_env(tmp_path), bare_installer.parent
    checked = run_offline(
        [*BARE, str(bare_installer), "--bundle", str(archive), "--verify-only", "--allowed-signers", str(allowed)],
        env=env,
        cwd=cwd,
    )
    assert "signature: good, by packer@prechange.example" in checked.stdout
    prefix = tmp_path / "prefix"
    done = run_offline(
        [
            *BARE,
            str(bare_installer),
            "--bundle",
            str(archive),
            "--prefix",
            str(prefix),
            "--allowed-signers",
            str(allowed),
        ],
        env=env,
        cwd=cwd,
    )
    model = next(i for i in manifest["items"] if i["kind"] == "model")
    assert f"model   local/tiny-model @ {model['revision']} -> " in done.stdout
    assert "dataset tiny_alpaca -> " in done.stdout and "OK: 8 files verified" in done.stdout
    snapshot = prefix / "hf-home" / "hub" / "models--local--tiny-model" / "snapshots" / model["revision"]
    assert (snapshot / "config.json").is_symlink() and (snapshot / "config.json").read_bytes() == config
    info = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    assert info == {"tiny_alpaca": {"file_name": "tiny_alpaca/tiny_alpaca.json"}}
    assert "export HF_HUB_OFFLINE=1" in (prefix / "ferry.env").read_text()
    assert (prefix / ".ferry" / "allowed_signers").read_text() == allowed.read_text()  # the prefix's signer policy
    again = run_offline([*BARE, str(bare_installer), "--verify-prefix", str(prefix)], env=env, cwd=cwd)
    assert again.stdout.startswith("OK: 1 bundle(s), 3 installed files")
    assert verify_prefix(prefix).files_checked == 3  # and ferry itself reads what install.py wrote


# ------------------------------------------------------------------------------------------------ the joining


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """``(module, at the top level, line)`` of every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import"
            found.append((node.module or "", id(node) in top, node.lineno))
    return found


def test_installer_modules_import_only_the_standard_library_the_foundation_and_each_other() -> None:
    installer = sorted((ROOT / "bundler" / "installer").glob("*.py"))
    assert len(installer) > 10
    own = {f"bundler.installer.{p.stem}" for p in installer} - {"bundler.installer.generate"}
    for path in installer + [ROOT.joinpath(*m.split(".")).with_suffix(".py") for m in FOUNDATION]:
        is_foundation = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") in FOUNDATION
        for module, top, line in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module}"
            if module.split(".")[0] in sys.stdlib_module_names:
                continue
            assert path.stem != "generate", f"{where} (the generator uses the standard library only)"
            assert top, f"{where} (project imports only at the top level)"
            assert module in FOUNDATION or (module in own and not is_foundation), where
    assert _imports(ROOT / "bundler" / "installer" / "__init__.py") == []


def test_the_generated_file_binds_each_top_level_name_once(generated: str) -> None:
    seen: dict[str, int] = {}
    for node in ast.parse(generated).body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.asname or a.name.split(".")[0] for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for name in names:
            assert name not in seen, f"{name!r} bound at lines {seen[name]} and {node.lineno}"
            seen[name] = node.lineno
    assert {"main", "install_bundle", "IntegrityError", "OFFLINE_ENV", "TOOL_FILES", "size_and_sha256"} <= set(seen)
    assert "sha256_file" in seen  # ferry.fsutil's (hex); the installer's own is size_and_sha256


def _fake_tree(root: Path, modules: dict[str, str]) -> Path:
    """A project tree under ``root`` holding ``modules`` (dotted name -> source) and a minimal ferry.errors."""
    modules = {"ferry.errors": "class FerryError(Exception):\n    exit_code = 1\n", **modules}
    for name, source in modules.items():
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


MAIN = "bundler.installer.main"


def test_the_generator_joins_a_small_tree_into_a_file_that_runs(tmp_path: Path) -> None:
    root = _fake_tree(
        tmp_path,
        {
            "bundler.installer.words": '"""Words."""\n\nimport os\n\nfrom ferry.errors import FerryError\n\n\n'
            'def word() -> str:\n    return os.path.basename("/x/hello")\n',
            MAIN: "import sys\n\nfrom bundler.installer.words import word\n\n\ndef main() -> int:\n"
            "    print(word())\n    return 0\n\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
        },
    )
    text = render(root)
    assert "from bundler" not in text and "from ferry" not in text and text.count("import os\n") == 1
    assert (
        text.index("# ferry/errors.py")
        < text.index("# bundler/installer/words.py")
        < text.index("# bundler/installer/main.py")
    )
    assert "# Uses, from the sections above: word (bundler/installer/words.py)" in text
    script = tmp_path / "run" / "install.py"
    script.parent.mkdir()
    script.write_text(text)
    assert subprocess.run([*BARE, str(script)], capture_output=True, text=True, check=True).stdout == "hello\n"


@pytest.mark.parametrize(
    "modules, refusal",
    [
        pytest.param(
            {
                "bundler.installer.a": "def helper():\n    return 1\n\n\nx = 1\n",
                "bundler.installer.b": "def helper():\n    return 2\n\n\ny = 2\n",
                MAIN: "from bundler.installer.a import x\nfrom bundler.installer.b import y\n",
            },
            "'helper' means two things",
            id="defined-twice",
        ),
        pytest.param(
            {
                "bundler.installer.a": "from pathlib import Path\n\nx = Path\n",
                "bundler.installer.b": "class Path:\n    pass\n\n\ny = Path\n",
                MAIN: "from bundler.installer.a import x\nfrom bundler.installer.b import y\n",
            },
            "'Path' means two things",
            id="import-and-definition",
        ),
        pytest.param({MAIN: "import ferry.errors as e\n"}, "no module objects", id="import-module-as"),
        pytest.param(
            {MAIN: "from ferry.errors import FerryError as Base\n"}, "import the names as they are defined", id="alias"
        ),
        pytest.param({MAIN: "import yaml\n"}, "yaml, which is not in the standard library", id="third-party"),
        pytest.param({MAIN: "from bundler.spec import PackSpec\n"}, "neither a foundation module", id="heavy"),
        pytest.param(
            {"bundler.installer.a": "x = 1\n", MAIN: "from bundler.installer.a import y\n"},
            "defines no top-level 'y'",
            id="unresolved-name",
        ),
        pytest.param({MAIN: "def open(path):\n    return path\n"}, "shadows the builtin", id="builtin"),
        pytest.param(
            {
                "bundler.installer.a": "from bundler.installer.main import m\n\na = 1\n",
                MAIN: "from bundler.installer.a import a\n\nm = 1\n",
            },
            "import cycle: bundler.installer.main -> bundler.installer.a -> bundler.installer.main",
            id="cycle",
        ),
        pytest.param(
            {MAIN: "def f():\n    from ferry.errors import FerryError\n    return FerryError\n"},
            "below the top level",
            id="nested-project-import",
        ),
        pytest.param({MAIN: "from . import a\n"}, "relative import", id="relative"),
        pytest.param(
            {MAIN: "from bundler.installer import a\n", "bundler.installer.a": "a = 1\n"},
            "import names from the module that defines them",
            id="package-import",
        ),
    ],
)
def test_the_generator_refuses_what_it_cannot_join_safely(tmp_path: Path, modules: dict, refusal: str) -> None:
    with pytest.raises(GenerateError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        render(_fake_tree(tmp_path, modules))
