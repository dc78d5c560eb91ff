"""llama.cpp itself for the GGUF tests: llama-cpp-python built once per machine from the pinned sdist.

The build is the sdist's own CMake project (``CMakeLists.txt`` at its root, llama.cpp under ``vendor/``), cut to
what the Python bindings load: the target ``llama`` and the ggml libraries it links (``libllama``, ``libggml``,
``libggml-base``, ``libggml-cpu``). Nothing else is compiled: no mtmd/llava (``LLAVA_BUILD=OFF``), no common
library, tools, examples, tests or server (78 compile steps instead of the Python package's full build).
``GGML_NATIVE=OFF`` so the cached build runs on other x86-64 CPUs too; ``-O0``: the models the tests run are tiny,
so the optimiser's time is not won back. It runs with ``-j2`` at the tests' own priority (under ``nice`` a suite
that keeps both cores busy starved it past a test's 600 s timeout, while the test waiting on it held a worker
idle), in its own process group (killed whole when the test waiting on it is stopped), and lands atomically::

    ${XDG_CACHE_HOME:-~/.cache}/ferry-tests/llama-cpp/<sdist sha256>/
    ├── BUILD.json                build seconds, CMake options, compiler
    └── llama_cpp/                the sdist's Python package, unchanged
        └── lib/libllama.so ...   the shared libraries (RPATH $ORIGIN)

A half build is never reused: everything happens in ``.build-*`` beside the target and is renamed into place only
after ``import llama_cpp`` works from it in a fresh interpreter. A failed build FAILS the test (pytest.fail with the
end of the build log), it never skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.chat_templates import SHA256
from tests.support.llama_cpp_sdist import sdist_path
from tests.support.suite import machine_lock

#: CMake options of the test build (see the module docstring).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG",
    "-DGGML_NATIVE=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
#: The only CMake target built; its dependencies are the ggml libraries.
TARGET = "llama"


def build_dir() -> Path:
    """Where the finished build lives (a folder to put on ``sys.path`` / ``PYTHONPATH``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ferry-tests" / "llama-cpp" / SHA256


def _complete(path: Path) -> bool:
    """A finished build made with today's :data:`CMAKE_OPTIONS` (a build with other options is made again)."""
    try:
        record = json.loads((path / "BUILD.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("cmake_options") == list(CMAKE_OPTIONS) and (path / "llama_cpp" / "lib" / "libllama.so").exists()


def _run(argv: list[str], log, cwd: Path | None = None) -> None:
    """Run ``argv`` in its own process group, output to ``log``; on any interruption (the test's timeout, Ctrl-C)
    the whole group is killed before the exception goes on: cmake's compilers must not outlive the build folder."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code != 0:
        raise RuntimeError(f"{argv[0]} exited {code}")


def build_llama_cpp() -> Path:
    """The built llama-cpp-python folder, building it first when this machine has none (see the module
    docstring). Fails the calling test, with the end of the build log, when cmake or the compiler fails."""
    target = build_dir()
    if _complete(target):
        return target
    with machine_lock("llama-cpp-build"):  # one build per machine: a second pytest process waits and reuses it
        if not _complete(target):
            _build(target)
    return target


def _build(target: Path) -> None:
    sdist = sdist_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    log_path = target.parent / f"{SHA256[:12]}-build.log"
    try:
        started = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            for tool in ("cmake", "c++"):
                if shutil.which(tool) is None:
                    raise RuntimeError(f"{tool} is not installed (make test-deps installs cmake and g++)")
            with tarfile.open(sdist, "r:gz") as tar:
                tar.extractall(staging / "src", filter="data")
            src = next((staging / "src").iterdir())
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", "-S", str(src), "-B", str(staging / "build"), *generator, *CMAKE_OPTIONS], log)
            _run(["cmake", "--build", str(staging / "build"), "--target", TARGET, "-j", "2"], log)
            package = staging / "out" / "llama_cpp"
            shutil.copytree(src / "llama_cpp", package)
            lib = package / "lib"
            lib.mkdir(exist_ok=True)
            for so in (staging / "build" / "bin").glob("lib*.so*"):
                shutil.copy2(so, lib / so.name, follow_symlinks=False)
            # the bindings must load from the staged copy before it may be reused
            _run([sys.executable, "-c", "import llama_cpp; llama_cpp.llama_backend_init()"], log, cwd=staging / "out")
            seconds = time.perf_counter() - started
            compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
            (staging / "out" / "BUILD.json").write_text(
                json.dumps(
                    {
                        "sdist": sdist.name,
                        "sha256": SHA256,
                        "target": TARGET,
                        "cmake_options": list(CMAKE_OPTIONS),
                        "seconds": round(seconds, 1),
                        "compiler": compiler,
                        "machine": platform.machine(),
                        "cpus": os.cpu_count(),
                    },
                    indent=1,
                )
            )
        if target.exists() and not _complete(target):  # made with other options: replaced whole
            shutil.rmtree(target)
        try:
            os.rename(staging / "out", target)
        except OSError:
            if not _complete(target):  # another session's complete build is as good as ours
                raise
    except Exception as exc:  # noqa: BLE001 - the reason goes into the failure
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:] if log_path.is_file() else ""
        pytest.fail(f"cannot build llama-cpp-python from {sdist.name}: {exc}\n{tail}", pytrace=False)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


#: Seconds the one-time build may add to the timeout of a test that would make it (122.6 s wall on an idle 2-core
#: machine; several times that beside a suite that keeps both cores busy).
BUILD_TIMEOUT_S = 1200.0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """While this machine has no build, every test that uses :func:`llama_cpp_build` may take
    :data:`BUILD_TIMEOUT_S` more than its timeout (tests/support/suite.py set it): whichever of them starts first
    makes the build in its setup, and the others wait for it on the build's lock."""
    if _complete(build_dir()):
        return
    for item in items:
        if "llama_cpp_build" not in getattr(item, "fixturenames", ()):
            continue
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark is not None and mark.args else 0.0
        item.add_marker(pytest.mark.timeout(seconds + BUILD_TIMEOUT_S), append=False)


@pytest.fixture(scope="session")
def llama_cpp_build() -> Path:
    """The folder holding the built ``llama_cpp`` package (put it on ``sys.path`` or ``PYTHONPATH``)."""
    return build_llama_cpp()


@pytest.fixture()
def llama_cpp_module(llama_cpp_build, monkeypatch):
    """``llama_cpp`` imported from the test build for one test; afterwards it is no longer importable, so that
    other tests see the machine as it is (llama-cpp-python not installed)."""
    monkeypatch.syspath_prepend(str(llama_cpp_build))
    import llama_cpp

    yield llama_cpp
    for name in [n for n in sys.modules if n == "llama_cpp" or n.startswith("llama_cpp.")]:
        del sys.modules[name]
