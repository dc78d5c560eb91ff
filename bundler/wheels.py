"""Wheels for the isolated host: resolved FOR THE TARGET with uv, downloaded with pip, locked by hash.

Three steps, none of which reads this host's pip or uv configuration:

1. **Resolve** (:func:`resolve`): ``uv pip compile --python-version X.Y --python-platform P --format
   pylock.toml`` (``--only-binary :all:`` unless the target is this very host; ``--torch-backend B`` for a
   torch build other than ``pypi``). uv evaluates environment markers for the target (``exceptiongroup;
   python_version < "3.11"`` is in the set for a 3.10 target even when this host runs 3.13), and its
   ``pylock.toml`` (PEP 751) names every file with its URL, size and sha256. Among the files uv lists for a
   project, the one the target prefers (its most specific compatible tag, pip's order) is kept.
2. **Download** (:func:`download`): ``pip download --no-deps --no-index`` of exactly those URLs, each with its
   ``--hash``, under the target's tags. ``ferry pack --dry-run`` stops after step 1 and prints the list.
   A project published as a source archive only (``langdetect``, which lm-eval's ifeval imports) is resolved
   again with ``--no-binary PROJECT`` and built here with ``pip wheel``; the wheel is carried only when it is pure
   Python (``py3-none-any``: it installs on any target), else the pack stops naming the project and its tag.
3. **Lock** (:func:`lock_text`): ``requirements.lock`` with one ``NAME==VERSION --hash=sha256:HEX`` line per
   project, so the isolated host installs with::

       pip install --no-index --find-links wheels --require-hashes -r wheels/requirements.lock

No configuration leaks in: uv runs with ``--no-config`` and without ``UV_*`` variables that change what is
resolved; pip runs with ``PIP_CONFIG_FILE=/dev/null`` and without ``PIP_*`` variables other than transport
settings (certificates, proxy, timeouts). Indexes are only what the spec names: ``index_url`` (default PyPI),
``extra_index_urls``, ``find_links`` (a folder of wheels or a company mirror's page), and the torch build's
index. uv's default index strategy applies (``first-index``: a project is taken from the first index that has
it; extra indexes come before ``index_url``). They are recorded in the manifest's ``target.indexes``.

Target platforms are spelled as pip spells them (``manylinux_2_28_x86_64``, ``manylinux2014_aarch64``,
``musllinux_1_2_x86_64``, ``macosx_12_0_arm64``, ``win_amd64``) or as uv spells them (``x86_64-manylinux_2_28``,
``linux``, ``macos``, ``windows``, ``aarch64-apple-darwin``, ...); :func:`uv_platform` maps them onto uv's
``--python-platform`` (for manylinux the newest uv target not newer than the given glibc; macOS versions go
through ``MACOSX_DEPLOYMENT_TARGET``). Several pip tags must name one OS and architecture (the newest glibc
wins). A bare ``linux_x86_64`` names no glibc and is refused.

Torch builds (``--torch``): ``pypi`` takes what PyPI serves for the platform (on Linux x86_64 a CUDA build with
``nvidia-*`` wheels); ``cpu``, ``cu118`` ... ``cu130``, ``rocm6.4`` (and the other values uv's
``--torch-backend`` knows) take torch and its companion wheels from ``https://download.pytorch.org/whl/<build>``.

With no requirements, the wheel set is ferry's own runtime requirements (from the source checkout's
``pyproject.toml``, else the installed metadata, extras left out) plus ferry's own wheel, built from the source
checkout with ``pip wheel --no-deps --no-build-isolation``; for that default set ``constraints`` defaults to
the project's ``constraints.txt`` (it pins ``torch``). A set of your own gets only the constraints you give.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from bundler.spec import EngineSpec, PackSpec, TargetSpec
from ferry.errors import ConfigError, SourceError
from ferry.fsutil import format_bytes

DISTRIBUTION = "llm-ferry"
PYPI_SIMPLE = "https://pypi.org/simple"
PYTORCH_INDEX = "https://download.pytorch.org/whl/{build}"
#: Name of the PEP 751 lock uv writes; carried in the bundle beside ``requirements.lock``.
PYLOCK_NAME = "pylock.toml"
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")
#: glibc minors that uv 0.9+ accepts as ``ARCH-manylinux_2_MINOR`` (``uv help pip compile``).
_UV_GLIBC_MINORS = (17, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40)
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_UV_ALIASES = {
    "linux": "x86_64-unknown-linux-gnu",
    "windows": "x86_64-pc-windows-msvc",
    "macos": "aarch64-apple-darwin",
}
_WINDOWS = {
    "win_amd64": "x86_64-pc-windows-msvc",
    "win_arm64": "aarch64-pc-windows-msvc",
    "win32": "i686-pc-windows-msvc",
}
#: Environment variables kept for the resolver and the downloader: transport only, never what is resolved.
_PIP_TRANSPORT = {
    "PIP_CERT",
    "PIP_CLIENT_CERT",
    "PIP_PROXY",
    "PIP_TIMEOUT",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_RETRIES",
    "PIP_TRUSTED_HOST",
    "PIP_CACHE_DIR",
    "PIP_NO_CACHE_DIR",
}
_UV_TRANSPORT = {
    "UV_CACHE_DIR",
    "UV_NO_CACHE",
    "UV_NATIVE_TLS",
    "UV_SYSTEM_CERTS",
    "UV_HTTP_TIMEOUT",
    "UV_HTTP_RETRIES",
    "UV_CONCURRENT_DOWNLOADS",
    "UV_INSECURE_HOST",
}


def canonical_name(name: str) -> str:
    """PEP 503 normalised project name: ``Markup_Safe`` -> ``markup-safe``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel_filename(filename: str) -> tuple[str, str]:
    """``(canonical name, version)`` of a wheel file name (PEP 427). Raises SourceError when malformed."""
    match = _WHEEL_NAME.match(filename)
    if not match:
        raise SourceError(f"not a wheel file name: {filename!r}")
    return canonical_name(match["name"]), match["version"]


def project_root() -> Path | None:
    """The source checkout ferry runs from (the folder with ferry's ``pyproject.toml``), or None."""
    import ferry

    root = Path(ferry.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"llm-ferry"', pyproject.read_text(encoding="utf-8")):
        return root
    return None


def default_constraints() -> Path | None:
    """The project's ``constraints.txt`` (next to ``pyproject.toml``), or None outside a source checkout."""
    root = project_root()
    if root is not None and (root / "constraints.txt").is_file():
        return root / "constraints.txt"
    return None


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def ferry_requirements() -> list[str]:
    """ferry's runtime requirements, extras left out (e.g. ``torch>=2.6``).

    From the source checkout's ``pyproject.toml`` when ferry runs from one (the wheel built from it declares
    exactly these), else from the installed ``llm-ferry`` metadata.

    Raises:
        SourceError: neither a source checkout nor an installed ``llm-ferry`` distribution.
    """
    root = project_root()
    if root is not None:
        project = _toml_loads((root / "pyproject.toml").read_text(encoding="utf-8")).get("project", {})
        return list(project.get("dependencies", []))
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(
            f"the {DISTRIBUTION} distribution is not installed, so its requirements are unknown; "
            f"install ferry with pip or give --requirements"
        ) from None
    return [r for r in requires if not re.search(r"\bextra\s*==", r)]


# ------------------------------------------------------------------------------------------------------------
# The target: Python, platform, torch build.
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A complete target (the spec's with this host's values filled in).

    ``platforms`` are pip tags in the target's order of preference (``manylinux_2_28_x86_64``, then every
    older manylinux it also runs, ...), ``uv_platform`` is uv's ``--python-platform`` value, ``env`` holds
    extra variables for uv (``MACOSX_DEPLOYMENT_TARGET``). ``host`` is True when the target is this very
    interpreter's (then sdists may be built here).
    """

    python: str
    platform: str
    platforms: tuple[str, ...]
    implementation: str
    abi: str
    torch: str
    uv_platform: str
    host: bool
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``CPython 3.10 on manylinux_2_28_x86_64, torch build pypi``."""
        return f"CPython {self.python} on {self.platform}, torch build {self.torch}"


def host_platform() -> str:
    """This host's most specific pip platform tag (``manylinux_2_36_x86_64``, ``macosx_14_0_arm64``, ...)."""
    from packaging import tags

    generic = None
    for tag in tags.platform_tags():
        if tag.startswith("linux_"):
            generic = generic or tag
            continue
        return tag
    if generic is None:
        raise SourceError("cannot tell this host's platform tag; give --platform")
    return generic


def _arch_norm(arch: str) -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch.lower(), arch.lower())


def _parse_platform(tag: str) -> tuple[str, str, tuple[int, int] | None]:
    """``(os, arch, version)`` of one platform as pip or uv spells it; os is manylinux/musllinux/macos/windows.

    Raises:
        ConfigError: a platform uv cannot resolve for (named, with what to write instead).
    """
    raw = tag.strip()
    tag = _UV_ALIASES.get(raw, raw)
    if tag in _WINDOWS:
        return "windows", _arch_norm(_WINDOWS[tag].split("-")[0]), None
    m = re.fullmatch(r"(x86_64|aarch64|i686)-pc-windows-msvc", tag)
    if m:
        return "windows", m[1], None
    m = re.fullmatch(r"(x86_64|aarch64)-unknown-linux-gnu", tag)
    if m:  # uv: "Equivalent to ARCH-manylinux_2_28"
        return "manylinux", m[1], (2, 28)
    m = re.fullmatch(r"(x86_64|aarch64)-unknown-linux-musl", tag)
    if m:
        return "musllinux", m[1], (1, 2)
    m = re.fullmatch(r"(x86_64|aarch64)-manylinux(?:2014|_(\d+)_(\d+))", tag)
    if m:
        return "manylinux", m[1], (int(m[2]), int(m[3])) if m[2] else (2, 17)
    m = re.fullmatch(r"(x86_64|aarch64)-apple-darwin", tag)
    if m:
        return "macos", m[1], None
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag) or re.fullmatch(
        r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag
    )
    if m:
        if m[1].startswith("manylinux"):
            version, arch = _LEGACY_MANYLINUX[m[1]], m[2]
        else:
            version, arch = (int(m[1]), int(m[2])), m[3]
        return "manylinux", arch, version
    m = re.fullmatch(r"musllinux_(\d+)_(\d+)_(\w+)", tag)
    if m:
        return "musllinux", m[3], (int(m[1]), int(m[2]))
    m = re.fullmatch(r"macosx_(\d+)_(\d+)_(\w+)", tag)
    if m:
        return "macos", m[3], (int(m[1]), int(m[2]))
    if re.fullmatch(r"linux_\w+", tag):
        raise ConfigError(
            f"platform {raw!r} names no glibc version; give the oldest glibc of the target as a "
            f"manylinux tag, e.g. manylinux_2_28_{tag[6:]} (glibc >= 2.28) or manylinux2014_{tag[6:]}"
        )
    raise ConfigError(
        f"platform {raw!r} is not a pip platform tag (manylinux_2_28_x86_64, musllinux_1_2_x86_64, "
        f"macosx_12_0_arm64, win_amd64) nor a uv --python-platform value (linux, macos, windows, "
        f"x86_64-manylinux_2_28, ...)"
    )


def uv_platform(platforms: list[str] | tuple[str, ...]) -> tuple[str, str, dict[str, str]]:
    """Map pip/uv platform names onto one uv ``--python-platform`` value.

    Returns ``(uv_platform, pip_tag, env)``: e.g. ``["manylinux_2_30_x86_64"]`` ->
    ``("x86_64-manylinux_2_28", "manylinux_2_30_x86_64", {})`` (uv knows glibc 2.17, 2.28, 2.31 ... 2.40 and
    gets the newest it knows that is not newer than the target's, which is safe: older wheels run on a newer
    glibc); ``["macosx_12_0_arm64"]`` -> ``("aarch64-apple-darwin", "macosx_12_0_arm64",
    {"MACOSX_DEPLOYMENT_TARGET": "12.0"})``; ``["win_amd64"]`` -> ``("x86_64-pc-windows-msvc", "win_amd64",
    {})``; ``["linux"]`` (uv's alias) -> ``("x86_64-unknown-linux-gnu", "manylinux_2_28_x86_64", {})``.
    Several manylinux tags of one architecture keep the newest glibc.

    Raises:
        ConfigError: no platform, platforms of different OS/architecture, a glibc older than 2.17, a musl
            older than 1.2, an architecture uv cannot target.
    """
    if not platforms:
        raise ConfigError("no target platform given")
    parsed = [_parse_platform(p) for p in platforms]
    kinds = {(os_, arch) for os_, arch, _ in parsed}
    if len(kinds) != 1:
        raise ConfigError(
            f"target platforms {list(platforms)} name different systems or architectures; one bundle "
            f"serves one platform: pack once per target"
        )
    ((os_, arch),) = kinds
    versions = [v for _, _, v in parsed if v is not None]
    version = max(versions) if versions else None
    if os_ == "manylinux":
        if arch not in ("x86_64", "aarch64"):
            raise ConfigError(f"uv resolves Linux wheels for x86_64 and aarch64 only, not {arch!r}")
        assert version is not None
        if version < (2, 17):
            raise ConfigError(
                f"target glibc {version[0]}.{version[1]} is older than 2.17 (manylinux2014), the oldest uv resolves for"
            )
        minor = max(m for m in _UV_GLIBC_MINORS if (2, m) <= version) if version[0] == 2 else _UV_GLIBC_MINORS[-1]
        return f"{arch}-manylinux_2_{minor}", f"manylinux_{version[0]}_{version[1]}_{arch}", {}
    if os_ == "musllinux":
        if arch not in ("x86_64", "aarch64") or version is None or version < (1, 2):
            raise ConfigError(
                f"uv resolves musl wheels for musllinux_1_2 (or newer) on x86_64 and aarch64 only, "
                f"not {list(platforms)}"
            )
        return f"{arch}-unknown-linux-musl", f"musllinux_{version[0]}_{version[1]}_{arch}", {}
    if os_ == "macos":
        arch = {"aarch64": "arm64"}.get(arch, arch)
        if arch not in ("arm64", "x86_64"):
            raise ConfigError(f"give the macOS architecture (arm64 or x86_64), not {arch!r}")
        if version is None:
            version = (13, 0)  # uv's default minimum macOS
        triple = "aarch64-apple-darwin" if arch == "arm64" else "x86_64-apple-darwin"
        return (
            triple,
            f"macosx_{version[0]}_{version[1]}_{arch}",
            {"MACOSX_DEPLOYMENT_TARGET": f"{version[0]}.{version[1]}"},
        )
    tag = {"x86_64": "win_amd64", "aarch64": "win_arm64", "i686": "win32"}.get(arch)
    if tag is None:
        raise ConfigError(f"uv resolves Windows wheels for x86_64, arm64 and x86 only, not {arch!r}")
    return _WINDOWS[tag], tag, {}


def pip_platforms(tag: str) -> list[str]:
    """Every pip platform tag the target ``tag`` runs, most specific first (pip's order): for
    ``manylinux_2_28_x86_64`` that is ``manylinux_2_28_x86_64``, ``manylinux_2_27_x86_64`` ...
    ``manylinux_2_17_x86_64``, ``manylinux2014_x86_64``, ... ``manylinux1_x86_64``; macOS goes through
    ``packaging.tags.mac_platforms``."""
    from packaging import tags

    os_, arch, version = _parse_platform(tag)
    if os_ == "manylinux":
        assert version is not None
        out = []
        for minor in range(version[1], 4, -1):
            out.append(f"manylinux_2_{minor}_{arch}")
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(minor)
            if legacy:
                out.append(f"{legacy}_{arch}")
        return out
    if os_ == "musllinux":
        assert version is not None
        return [f"musllinux_{version[0]}_{m}_{arch}" for m in range(version[1], -1, -1)]
    if os_ == "macos":
        return list(tags.mac_platforms(version or (13, 0), {"aarch64": "arm64"}.get(arch, arch)))
    return [tag]


def resolve_target(spec: TargetSpec) -> Target:
    """Fill ``spec`` with this host's values and map it onto uv. See :func:`uv_platform` for platforms.

    Raises:
        ConfigError: an implementation other than CPython (``cp``), an ABI other than the version's default
            ``cpXY``, or a platform :func:`uv_platform` refuses.
    """
    host_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = spec.python_version or host_python
    if spec.implementation not in ("cp", "", None):
        raise ConfigError(f"target.implementation {spec.implementation!r}: ferry resolves for CPython ('cp') only")
    abi = f"cp{python.replace('.', '')}"
    if spec.abi not in (None, "", abi):
        raise ConfigError(f"target.abi {spec.abi!r}: uv resolves for the default ABI of Python {python} ({abi})")
    platforms = list(spec.platforms) or [host_platform()]
    uv_plat, tag, env = uv_platform(platforms)
    host = python == host_python and not spec.platforms and sys.implementation.name == "cpython"
    return Target(
        python=python,
        platform=tag,
        platforms=tuple(pip_platforms(tag)),
        implementation="cp",
        abi=abi,
        torch=spec.torch,
        uv_platform=uv_plat,
        host=host,
        env=env,
    )


def target_tags(target: Target) -> list[Any]:
    """The target's ``packaging.tags.Tag`` list, most preferred first (pip's order for ``--python-version``,
    ``--platform``, ``--implementation cp``)."""
    from packaging import tags

    version = tuple(int(x) for x in target.python.split("."))
    return [
        *tags.cpython_tags(version, [target.abi, "abi3", "none"], list(target.platforms)),
        *tags.compatible_tags(version, target.abi, list(target.platforms)),
    ]


def redact_url(url: str) -> str:
    """``url`` without a password or token: ``https://user:secret@mirror/simple`` -> ``https://***@mirror/simple``."""
    parsed = urlparse(url)
    if parsed.username is None and parsed.password is None:
        return url
    return parsed._replace(netloc="***@" + parsed.netloc.rpartition("@")[2]).geturl()


def _redact_indexes(indexes: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ([redact_url(u) for u in v] if isinstance(v, list) else redact_url(v) if isinstance(v, str) else v)
        for k, v in indexes.items()
    }


def target_record(target: Target, indexes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's ``target`` object: python, platforms (pip tags, the first is the target's own),
    implementation, abi, torch (the requested build), resolver platform, and the indexes used (credentials in
    their URLs replaced by ``***``)."""
    if indexes is not None:
        indexes = _redact_indexes(indexes)
    return {
        "python": target.python,
        "platforms": [target.platform],
        "implementation": target.implementation,
        "abi": target.abi,
        "torch": target.torch,
        "resolver_platform": target.uv_platform,
        **({"indexes": indexes} if indexes is not None else {}),
    }


# ------------------------------------------------------------------------------------------------------------
# Resolution with uv.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class LockedFile:
    """One file of the resolution: ``name`` (canonical), ``version``, ``filename``, ``url`` (https or file),
    ``sha256``, ``size`` in bytes (None when the index does not say), ``sdist`` (True for a source archive:
    for a target that is this host, or a project published as source only, built here and kept when pure)."""

    name: str
    version: str
    filename: str
    url: str
    sha256: str
    size: int | None
    sdist: bool = False


@dataclass
class Resolution:
    """The resolved wheel set for one target: ``files`` sorted by name, the ``requirements`` asked for, the
    ``indexes`` used, uv's ``pylock`` text, ``include_ferry`` (ferry's own wheel is built at pack time), the
    ``command`` that resolved it and ``seconds`` it took."""

    target: Target
    files: list[LockedFile]
    requirements: list[str]
    indexes: dict[str, Any]
    pylock: str
    include_ferry: bool
    constraints: str | None
    command: list[str]
    seconds: float

    @property
    def total_bytes(self) -> int:
        """Sum of the known sizes in bytes."""
        return sum(f.size or 0 for f in self.files)

    @property
    def torch_version(self) -> str | None:
        """The resolved torch version (``2.10.0+cu128``), None when torch is not in the set."""
        return next((f.version for f in self.files if f.name == "torch"), None)

    def summary(self) -> str:
        """The wheel list with sizes and the totals, for ``ferry pack --dry-run``."""
        rows = [("project", "version", "size", "file")]
        for f in self.files:
            rows.append((f.name, f.version, format_bytes(f.size) if f.size is not None else "?", f.filename))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths) + "  ----")
        unknown = [f.name for f in self.files if f.size is None]
        nvidia = [f for f in self.files if f.name.startswith("nvidia-")]
        head = f"{len(self.files)} files, {format_bytes(self.total_bytes)}"
        if unknown:
            head += f" + {len(unknown)} of unknown size ({', '.join(unknown)})"
        if self.torch_version:
            head += f"; torch {self.torch_version}"
            if nvidia:
                head += f" and {len(nvidia)} nvidia wheels ({format_bytes(sum(f.size or 0 for f in nvidia))})"
        if self.include_ferry:
            head += f"; plus {DISTRIBUTION}'s own wheel, built at pack time"
        built = [f.name for f in self.files if f.sdist and not self.target.host]
        if built:
            head += f"; built here from source, kept when pure Python: {', '.join(built)}"
        idx = _redact_indexes(self.indexes)
        lines += [
            "",
            f"target    {self.target.describe()} (uv --python-platform {self.target.uv_platform})",
            f"indexes   index {idx['index_url']}; extra {idx['extra_index_urls'] or '-'}; find-links "
            f"{idx['find_links'] or '-'}; torch {idx['torch_index'] or 'as the indexes serve it'}",
            f"total     {head}",
            f"resolved  in {self.seconds:.1f} s",
        ]
        return "\n".join(lines)


def _uv_bin() -> str:
    try:
        import uv
    except ImportError:
        found = shutil.which("uv")
        if found:
            return found
        raise SourceError("uv is not installed: ferry resolves wheels with uv (pip install uv)") from None
    return uv.find_uv_bin()


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without resolution-changing ``PIP_*`` / ``UV_*`` variables, pip's config files switched off."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("PIP_") and k not in _PIP_TRANSPORT)
        and not (k.startswith("UV_") and k not in _UV_TRANSPORT)
        and k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "MACOSX_DEPLOYMENT_TARGET")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_COLOR"] = "1"
    env["NO_COLOR"] = "1"
    env.update(extra or {})
    return env


def host_pip_config() -> dict[str, str]:
    """What this host's pip configuration (pip.conf files and ``PIP_*`` variables) sets for indexes:
    ``{"find-links": "/opt/wheels", "extra-index-url": "...", ...}``. ferry never uses these by itself; it
    names them when a resolution fails, and a caller may pass them on explicitly (``--find-links``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PIP_CONFIG_FILE"},
    )
    found: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^[^.]*\.([\w-]+)='(.*)'$", line.strip())
        if m and m[1] in ("index-url", "extra-index-url", "find-links", "constraint", "no-index"):
            values = found.get(m[1], "").split() + m[2].split()
            found[m[1]] = " ".join(dict.fromkeys(values))
    return found


def _file_url_path(url: str) -> Path | None:
    parsed = urlparse(url)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def _pick(
    package: dict[str, Any], target: Target, rank: dict[str, int], from_source: frozenset = frozenset()
) -> LockedFile:
    """The file of one pylock package the target installs: its best-ranked compatible wheel, else (for this
    host, or a project in ``from_source``: published as source only) the sdist."""
    from packaging.utils import parse_wheel_filename as parse_wheel

    name, version = canonical_name(package["name"]), str(package["version"])
    best: tuple[int, dict[str, Any], str] | None = None
    for wheel in package.get("wheels", []):
        url = wheel.get("url") or Path(wheel["path"]).resolve().as_uri()
        filename = wheel.get("name") or unquote(urlparse(url).path.rsplit("/", 1)[-1])
        try:
            tags = parse_wheel(filename)[3]
        except Exception:  # noqa: BLE001 - an unparsable file name is not a candidate
            continue
        score = min((rank[str(t)] for t in tags if str(t) in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, wheel, url)
    if best is not None:
        _, wheel, url = best
        entry, filename = wheel, unquote(urlparse(url).path.rsplit("/", 1)[-1])
        sdist = False
    elif package.get("sdist") and (target.host or name in from_source):
        entry = package["sdist"]
        url = entry.get("url") or Path(entry["path"]).resolve().as_uri()
        filename, sdist = unquote(urlparse(url).path.rsplit("/", 1)[-1]), True
    else:
        raise SourceError(
            f"{name} {version}: uv resolved it but no file of it fits {target.describe()} "
            f"(files: {[w.get('url', w.get('path')) for w in package.get('wheels', [])]})"
        )
    sha256 = (entry.get("hashes") or {}).get("sha256")
    if not sha256:
        raise SourceError(f"{name} {version}: the resolver gave no sha256 for {filename}")
    size = entry.get("size")
    local = _file_url_path(url)
    if size is None and local is not None and local.is_file():
        size = local.stat().st_size
    return LockedFile(name, version, filename, url, sha256, size, sdist)


#: uv's explanation when a project has no wheel at all (only a source archive): ``Because langdetect==1.0.9 has
#: no usable wheels`` / ``Because all versions of langdetect have no usable wheels``.
_SOURCE_ONLY = re.compile(
    r"Because (?:all versions of )?([A-Za-z0-9][A-Za-z0-9._\-]*?)(?:==\S+)? ha(?:s|ve) no usable wheels"
)
#: How many source-only projects one resolution may build here.
_MAX_SOURCE_BUILDS = 8


def _one_line(text: str) -> str:
    """uv's explanation as one line: ANSI codes and tree glyphs gone, wrapped lines joined."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [re.sub(r"^[\s×╰─▶│├]+", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("warning: The requested Python version", "Resolved "))]
    return " ".join(lines)


def _includes_ferry(spec: PackSpec) -> bool:
    """Whether ferry's own wheel and runtime requirements are the base of the set (no requirements given)."""
    wheels = spec.wheels
    if wheels.include_ferry is not None:
        return wheels.include_ferry
    return not wheels.requirements and not wheels.requirements_files


def wheel_requirements(spec: PackSpec) -> list[str]:
    """The requirement specifiers of ``spec``'s wheel set (files named in ``requirements_files`` come on top):
    the spec's own, else ferry's runtime requirements; then what ``serving``, ``training`` and ``eval`` add
    (llama.cpp's converter's Python needs, bundler.spec.TRAINING_REQUIREMENTS, ``lm-eval==X`` as installed here and
    what the planned tasks' helpers import, ``PackSpec.eval_requirements``).
    """
    wheels = spec.wheels
    requirements = list(wheels.requirements)
    if _includes_ferry(spec) and not requirements and not wheels.requirements_files:
        requirements = ferry_requirements()
    if "gguf" in spec.serving:  # llama.cpp's converter's Python needs (ferry/serving_tools.py)
        from ferry.serving_tools import CONVERTER_REQUIREMENTS

        requirements = [*requirements, *CONVERTER_REQUIREMENTS]
    for extra in spec.training:  # training packages asked for (bundler.spec.TRAINING_REQUIREMENTS)
        from bundler.spec import TRAINING_REQUIREMENTS

        requirements = [*requirements, *TRAINING_REQUIREMENTS[extra]]
    if spec.eval:  # lm-eval, as on this host: the tasks were planned with its registry (bundler/eval_tasks.py)
        from bundler.eval_tasks import lm_eval_requirement

        requirements = [*requirements, lm_eval_requirement(), *spec.eval_requirements]
    return requirements


def resolve(spec: PackSpec, *, work_dir: Path | None = None) -> Resolution:
    """Resolve ``spec.wheels`` for ``spec.target`` with ``uv pip compile``; download nothing.

    Returns a :class:`Resolution` whose ``files`` are exactly what :func:`download` fetches.

    Raises:
        SourceError: uv could not resolve (uv's own explanation, which names the package, the constraint and
            the platform or Python tag, is the message, on one line); uv is not installed.
        ConfigError: a requirements or constraints file does not exist; a target uv cannot serve.
    """
    wheels = spec.wheels
    target = resolve_target(spec.target)
    requirements, include_ferry, constraints = _resolve_inputs(spec)
    indexes: dict[str, Any] = {
        "index_url": wheels.index_url or PYPI_SIMPLE,
        "extra_index_urls": list(wheels.extra_index_urls),
        "find_links": [link if "://" in link else str(Path(link).resolve()) for link in wheels.find_links],
        "torch_index": None if target.torch == "pypi" else PYTORCH_INDEX.format(build=target.torch),
    }
    described = [*requirements, *(f"-r {Path(f).name}" for f in wheels.requirements_files)]
    if include_ferry:
        described.append(DISTRIBUTION)

    own_tmp = work_dir is None
    tmp = Path(tempfile.mkdtemp(prefix="ferry-resolve-")) if own_tmp else work_dir
    assert tmp is not None
    try:
        sources = [str(f) for f in wheels.requirements_files]
        if requirements or not sources:
            req_in = tmp / "requirements.in"
            req_in.write_text("".join(f"{r}\n" for r in requirements), encoding="utf-8")
            sources.insert(0, str(req_in))
        out = tmp / PYLOCK_NAME
        cmd = _compile_command(target, indexes, constraints, [*sources, "-o", str(out)])
        started = time.perf_counter()
        proc, from_source = _run_compile(cmd, target, tmp)
        seconds = time.perf_counter() - started
        if proc.returncode != 0 or not out.is_file():
            raise _resolve_error(proc, target, constraints)
        pylock = out.read_text(encoding="utf-8")
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    data = _toml_loads(pylock)
    rank = {str(t): i for i, t in enumerate(target_tags(target))}
    built = frozenset(from_source)
    files = sorted((_pick(p, target, rank, built) for p in data.get("packages", [])), key=lambda f: f.name)
    return Resolution(
        target=target,
        files=files,
        requirements=described,
        indexes=indexes,
        pylock=pylock,
        include_ferry=include_ferry,
        constraints=Path(constraints).read_text(encoding="utf-8") if constraints else None,
        command=cmd,
        seconds=seconds,
    )


def _resolve_inputs(spec: PackSpec) -> tuple[list[str], bool, Path | None]:
    """``(requirements, include_ferry, constraints file)`` of ``spec``'s wheel set, after checking that the files
    and folders it names exist.

    Raises:
        ConfigError: a requirements or constraints file does not exist; a local find_links is no folder.
    """
    wheels = spec.wheels
    for req_file in wheels.requirements_files:
        if not Path(req_file).is_file():
            raise ConfigError(f"requirements file {req_file} does not exist")
    requirements = wheel_requirements(spec)
    include_ferry = _includes_ferry(spec)
    constraints = wheels.constraints or (default_constraints() if include_ferry else None)
    if constraints is not None and not Path(constraints).is_file():
        raise ConfigError(f"constraints file {constraints} does not exist")
    for link in wheels.find_links:
        if "://" not in link and not Path(link).is_dir():
            raise ConfigError(f"find_links: {link} is not a folder (give a folder of wheels or an URL)")
    return requirements, include_ferry, constraints


def _compile_command(target: Target, indexes: dict[str, Any], constraints: Path | None, args: list[str]) -> list[str]:
    """The ``uv pip compile`` command resolving for ``target`` from ``indexes`` alone (no configuration, no Python
    downloads; binary wheels only unless the target is this host), hashes generated, pylock.toml written;
    ``args``: the requirement files and the output."""
    cmd = [
        _uv_bin(),
        "pip",
        "compile",
        "--no-config",
        "--no-python-downloads",
        "--python",
        sys.executable,
        "--python-version",
        target.python,
        "--python-platform",
        target.uv_platform,
        "--generate-hashes",
        "--format",
        "pylock.toml",
        "--color",
        "never",
        "--no-progress",
        "--index-url",
        indexes["index_url"],
    ]
    if not target.host:
        cmd += ["--only-binary", ":all:"]
    if target.torch != "pypi":
        cmd += ["--torch-backend", target.torch]
    for url in indexes["extra_index_urls"]:
        cmd += ["--extra-index-url", url]
    for link in indexes["find_links"]:
        cmd += ["--find-links", link]
    if constraints is not None:
        cmd += ["-c", str(constraints)]
    return [*cmd, *args]


def _run_compile(cmd: list[str], target: Target, tmp: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``cmd`` (:func:`_compile_command`) in ``tmp``; when uv explains that a project has no usable wheel (and
    the target is not this host), run it again with ``--no-binary PROJECT`` inserted into ``cmd``, up to
    :data:`_MAX_SOURCE_BUILDS` projects. Returns the last run and those projects (built here, kept when pure
    Python)."""
    from_source: list[str] = []  # projects with no wheel at all: built here, kept when pure Python
    while True:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(target.env), cwd=tmp)
        source_only = _SOURCE_ONLY.search(_one_line(proc.stderr)) if proc.returncode != 0 else None
        if target.host or source_only is None or len(from_source) >= _MAX_SOURCE_BUILDS:
            break
        project = canonical_name(source_only.group(1))
        if project in from_source:
            break
        from_source.append(project)
        cmd[3:3] = ["--no-binary", project]  # after `uv pip compile`
    return proc, from_source


def _resolve_error(proc: subprocess.CompletedProcess, target: Target, constraints: Path | None) -> SourceError:
    """The error of a failed ``uv pip compile``: uv's explanation on one line, naming the constraints file and this
    host's pip configuration that ferry does not use (find-links, index-url, extra-index-url)."""
    explanation = _one_line(proc.stderr) or f"uv exit {proc.returncode}"
    hint = ""
    host = host_pip_config()
    unused = {k: v for k, v in host.items() if k in ("find-links", "index-url", "extra-index-url")}
    if unused:
        hint = (
            " (this host's pip configuration sets "
            + "; ".join(f"{k}={v}" for k, v in unused.items())
            + ", which ferry does not use unless given: --find-links / --index-url / "
            "--extra-index-url)"
        )
    if constraints is not None:
        hint = f" (constraints from {constraints})" + hint
    return SourceError(f"resolving wheels for {target.describe()} failed: {explanation}{hint}")


# ------------------------------------------------------------------------------------------------------------
# Download with pip.
# ------------------------------------------------------------------------------------------------------------


def _run_pip(args: list[str], *, what: str, progress: bool) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"]
    proc = subprocess.run(
        cmd, env=_clean_env(), text=True, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE
    )
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
        raise SourceError(f"{what} failed (pip exit {proc.returncode}): " + " | ".join(lines[-12:]))


def build_ferry_wheel(dest: Path, *, progress: bool = False) -> Path:
    """Build ferry's own wheel into ``dest`` from the source checkout; return its path.

    Raises:
        SourceError: ferry does not run from a source checkout, or the build failed.
    """
    root = project_root()
    if root is None:
        raise SourceError(
            "ferry does not run from a source checkout, so it cannot build its own wheel; give "
            "--requirements FILE (listing e.g. llm-ferry from your index) or --no-wheels"
        )
    before = set(dest.glob("*.whl"))
    _run_pip(
        ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(root)],
        what="building ferry's wheel",
        progress=progress,
    )
    built = [p for p in dest.glob("*.whl") if p not in before and parse_wheel_filename(p.name)[0] == DISTRIBUTION]
    if not built:
        built = [p for p in dest.glob("*.whl") if parse_wheel_filename(p.name)[0] == DISTRIBUTION]
    if not built:
        raise SourceError(f"pip wheel did not produce a {DISTRIBUTION} wheel in {dest}")
    return built[0]


def download(resolution: Resolution, dest: Path, *, progress: bool = True) -> list[Path]:
    """Fetch exactly ``resolution.files`` into ``dest``: ``pip download --no-deps`` of their URLs, each with
    its ``--hash`` (pip checks it), under the target's tags. An sdist (only ever for this host) goes through
    ``pip wheel --no-deps`` of its URL and hash instead (downloaded, checked and built in one step; its build
    dependencies come from the resolution's indexes). Returns the wheel paths.

    Raises:
        SourceError: pip failed (its last lines are in the message), or a file it should have written is
            missing.
    """
    dest.mkdir(parents=True, exist_ok=True)
    target = resolution.target
    wheels = [f for f in resolution.files if not f.sdist]
    sdists = [f for f in resolution.files if f.sdist]
    quiet = [] if progress else ["-q"]
    if wheels:
        _pip_download(wheels, dest, target, progress, quiet)
    out = []
    for f in wheels:
        path = dest / f.filename
        if not path.is_file():
            raise SourceError(f"pip download did not produce {f.filename} in {dest}")
        out.append(path)
    if sdists:
        out += _build_sdists(sdists, dest, target, resolution.indexes, progress, quiet)
    return out


def _requirements_file(dest: Path, files: list[LockedFile], name: str) -> Path:
    """Write ``dest/name``: one ``NAME @ URL --hash=sha256:HEX`` line per file; return its path."""
    path = dest / name
    path.write_text("".join(f"{f.name} @ {f.url} --hash=sha256:{f.sha256}\n" for f in files), encoding="utf-8")
    return path


def _pip_download(wheels: list[LockedFile], dest: Path, target: Target, progress: bool, quiet: list[str]) -> None:
    """``pip download`` the resolved ``wheels`` into ``dest`` by URL and hash, under the target's tags (unless it is
    this host).

    Raises:
        SourceError: pip failed.
    """
    reqs = _requirements_file(dest, wheels, ".ferry-download.txt")
    # every requirement is a direct URL with --no-deps: no index is consulted
    args = [
        "download",
        "--no-deps",
        "--no-index",
        "--dest",
        str(dest),
        "--progress-bar",
        "on" if progress else "off",
        "-r",
        str(reqs),
        *quiet,
    ]
    if not target.host:
        args += [
            "--only-binary=:all:",
            "--python-version",
            target.python,
            "--implementation",
            "cp",
            "--abi",
            target.abi,
            "--abi",
            "abi3",
            "--abi",
            "none",
        ]
        for plat in target.platforms:
            args += ["--platform", plat]
    try:
        _run_pip(args, what=f"pip download of {len(wheels)} resolved wheels", progress=progress)
    finally:
        reqs.unlink(missing_ok=True)


def _build_sdists(
    sdists: list[LockedFile],
    dest: Path,
    target: Target,
    indexes: dict[str, Any],
    progress: bool,
    quiet: list[str],
) -> list[Path]:
    """Build a wheel of each of ``sdists`` into ``dest`` with ``pip wheel --no-deps`` (by URL and hash; the build
    dependencies from ``indexes``); for another target each must be pure Python (:func:`check_pure`). Returns
    the wheels.

    Raises:
        SourceError: pip failed, built no wheel of a project, or built a platform wheel for another target.
    """
    index_args = ["--index-url", indexes["index_url"]]
    for url in indexes["extra_index_urls"]:
        index_args += ["--extra-index-url", url]
    for link in indexes["find_links"]:
        index_args += ["--find-links", link]
    reqs = _requirements_file(dest, sdists, ".ferry-build.txt")
    try:
        _run_pip(
            ["wheel", "--no-deps", "-w", str(dest), "-r", str(reqs), *index_args, *quiet],
            what=f"building {', '.join(f.filename for f in sdists)}",
            progress=progress,
        )
    finally:
        reqs.unlink(missing_ok=True)
    out = []
    for f in sdists:
        built = [p for p in dest.glob("*.whl") if parse_wheel_filename(p.name)[0] == f.name]
        if not built:
            raise SourceError(f"pip wheel did not produce a wheel of {f.name} from {f.filename}")
        if not target.host:
            check_pure(built[0], f, target)
        out.append(built[0])
    return out


def check_pure(wheel: Path, source: LockedFile, target: Target) -> None:
    """Refuse a wheel built here from a source-only project for another target unless it is pure Python (every
    tag ``py3-none-any`` or ``py2.py3-none-any``), which installs on any target.

    Raises:
        SourceError: naming the project, its tag and the target.
    """
    from packaging.utils import parse_wheel_filename as parse_wheel

    tags = parse_wheel(wheel.name)[3]
    if not all(t.abi == "none" and t.platform == "any" and t.interpreter.startswith("py") for t in tags):
        wheel.unlink(missing_ok=True)
        shown = ".".join(sorted(str(t) for t in tags))
        raise SourceError(
            f"{source.name} {source.version} is published as source only ({source.filename}) and builds a "
            f"platform wheel here ({shown}), not one for {target.describe()}: build it on a host like the "
            f"target and give the wheel with --find-links"
        )


def download_wheels(
    spec: PackSpec, dest: Path, *, progress: bool = True, resolution: Resolution | None = None
) -> dict[str, Any]:
    """Resolve (:func:`resolve`) and download (:func:`download`) every wheel ``spec.wheels`` asks for, for
    ``spec.target``, into ``dest`` (an empty folder); build ferry's own wheel when it is part of the set.
    ``resolution`` is an earlier :func:`resolve` of the same spec (then nothing is resolved again).

    Returns ``{"wheels": [Path, ...], "spec": str, "requirements": [...], "target": {...}, "resolution":
    Resolution, "pylock": str, "expected": {file name: sha256}}``, the input of :func:`lock_text` and of the
    manifest's ``target`` and wheels item.

    Raises:
        SourceError: resolution or download failed (see :func:`resolve`, :func:`download`);
        ConfigError: a missing requirements / constraints file or find-links folder, an unservable target.
    """
    if resolution is None:
        resolution = resolve(spec)
    wheels = download(resolution, dest, progress=progress)
    if resolution.include_ferry:
        wheels.append(build_ferry_wheel(dest, progress=progress))
    if not wheels:
        raise SourceError("no wheels were resolved (empty requirements?); use --no-wheels to pack none")
    record = target_record(resolution.target, resolution.indexes)
    record["torch_version"] = resolution.torch_version
    return {
        "wheels": sorted(wheels),
        "spec": " ".join(resolution.requirements),
        "requirements": resolution.requirements,
        "target": record,
        "resolution": resolution,
        "pylock": resolution.pylock,
        "expected": {f.filename: f.sha256 for f in resolution.files if not f.sdist},
        "constraints": resolution.constraints,
    }


#: Where a serving engine's wheels and lock ride inside the bundle's wheels item: ``wheels/engines/NAME/``. pip's
#: and uv's ``--find-links wheels`` do not look into sub-folders, so the training environment never sees them.
ENGINES_DIRNAME = "engines"


def engine_spec(spec: PackSpec, engine: EngineSpec) -> PackSpec:
    """The pack spec of ``engine``'s own wheel set: its requirement alone, for the same target and from the same
    indexes, without ferry's wheel, constraints or extras (an engine pins its own torch and transformers)."""
    wheels = spec.wheels.model_copy(
        update={
            "requirements": [engine.requirement],
            "requirements_files": [],
            "constraints": None,
            "include_ferry": False,
        }
    )
    return spec.model_copy(update={"wheels": wheels, "serving": [], "training": [], "eval": []})


def resolve_engine(spec: PackSpec, engine: EngineSpec) -> Resolution:
    """Resolve ``engine`` for ``spec.target`` (:func:`engine_spec`, :func:`resolve`) and leave out the
    distributions its ``exclude`` names.

    Raises:
        ConfigError: ``exclude`` names a distribution the resolution does not hold (a typo would carry it anyway).
        SourceError: see :func:`resolve` (uv's explanation, prefixed with the engine).
    """
    try:
        resolution = resolve(engine_spec(spec, engine))
    except SourceError as exc:
        raise SourceError(f"serving engine {engine.engine} ({engine.requirement}): {exc}") from None
    drop = {canonical_name(n) for n in engine.exclude}
    missing = sorted(drop - {f.name for f in resolution.files})
    if missing:
        raise ConfigError(
            f"serving engine {engine.engine}: exclude names {', '.join(missing)}, which {engine.requirement} does "
            f"not pull in for this target"
        )
    resolution.files = [f for f in resolution.files if f.name not in drop]
    return resolution


def engines_summary(spec: PackSpec) -> list[str]:
    """What ``ferry pack --dry-run`` prints for each serving engine of ``spec``: a heading line (the engine, its
    requirement, what it leaves out) and its :meth:`Resolution.summary`.

    Raises:
        ConfigError, SourceError: see :func:`resolve_engine`.
    """
    out = []
    for engine in spec.engines:
        excluded = f", without {', '.join(engine.exclude)}" if engine.exclude else ""
        out.append(f"\nserving engine {engine.engine}: {engine.requirement}{excluded} (its own environment)")
        out.append(resolve_engine(spec, engine).summary())
    return out


def lock_text(meta: dict[str, Any], hashes: dict[str, str]) -> str:
    """The ``requirements.lock`` text: ``NAME==VERSION --hash=sha256:HEX`` per project, sorted by name.

    ``hashes`` maps wheel file names to their sha256 (computed while the wheels were copied into the bundle).
    Two wheels of one project and version (e.g. two platforms) share a line with two ``--hash`` options.

    Raises:
        SourceError: two different versions of one project (the set would not install with --require-hashes).
    """
    projects: dict[str, tuple[str, list[str]]] = {}
    for path in meta["wheels"]:
        name, version = parse_wheel_filename(Path(path).name)
        if name in projects and projects[name][0] != version:
            raise SourceError(f"two versions of {name} in the wheel set: {projects[name][0]} and {version}")
        projects.setdefault(name, (version, []))[1].append(hashes[Path(path).name])
    lines = ["# ferry wheel lock: pip install --no-index --find-links . --require-hashes -r requirements.lock"]
    for name in sorted(projects):
        version, digests = projects[name]
        lines.append(f"{name}=={version} " + " ".join(f"--hash=sha256:{d}" for d in sorted(set(digests))))
    return "\n".join(lines) + "\n"
