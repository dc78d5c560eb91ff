"""Which datasets an lm-evaluation-harness task reads, asked of lm-eval's own task registry.

``eval: [arc_easy, mmlu]`` in a pack spec (or ``ferry pack --eval TASK``) names tasks and groups as lm-eval
names them. :func:`plan_eval_tasks` expands groups and tags to their leaf tasks through lm-eval's
``TaskManager`` (its index, its YAML ``include`` chains, its group overrides) and reads each leaf's final config
without building the task: building one downloads its dataset, and a task's Python helpers may import packages
the packing host lacks. Every leaf becomes an :class:`EvalTask` naming the hub dataset repo and config that
``datasets.load_dataset(dataset_path, dataset_name)`` reads at run time; ``ferry pack`` carries that repo with
its ``datasets`` Arrow cache (bundler/hub_datasets.py), which is where ``load_dataset`` looks offline.

A task that would still need the network on the isolated host is refused here, before anything is downloaded:
a dataset built by a ``custom_dataset`` function or by a Python task class (ferry cannot see what they read),
``data_files`` given as URLs, a hub load with ``data_files`` / ``data_dir`` (a different cache than the one
carried), a metric lm-eval would fetch with ``evaluate.load``, and helper code of the task that downloads
(``load_dataset``, ``hf_hub_download``, ``urlopen``, ``requests``, ``nltk.download`` of a name that is not a
literal).

What a task's helper modules need beyond its dataset travels too. ``nltk.download("punkt_tab")`` (lm-eval's
ifeval calls it unless ``nltk.data.find`` already finds the resource) names an NLTK data package: ferry carries it
(bundler/nltk_data.py) and the isolated host's ``ferry.env`` points ``NLTK_DATA`` at it, so the call is never
made. A helper's ``import langdetect`` that lm-eval lists as an optional requirement (its ``ifeval`` extra) adds
that requirement to the wheels.

Written against lm-eval 0.4.13 (``lm_eval.tasks._factory.TaskFactory``); the ``eval`` extra pins that version.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferry.errors import ConfigError, NotInstalledError

if TYPE_CHECKING:
    from bundler.sources import PreparedItem
    from bundler.spec import SourceSpec

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
#: ``datasets``' packaged builders: a task naming one reads ``data_files`` (local paths or URLs), not a hub repo.
PACKAGED_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas", "xml", "webdataset", "sql"})
#: ``dataset_kwargs`` keys a hub load may carry: the carried cache serves them (``revision`` is pinned at pack).
_HUB_KWARGS = frozenset({"revision", "trust_remote_code"})
#: Calls in a task's helper modules that reach the network at run time.
_NETWORK_CALLS = re.compile(
    r"\b(nltk\.download|load_dataset|hf_hub_download|snapshot_download|urlopen|requests\.(?:get|post)|"
    r"evaluate\.load)\s*\("
)
#: ``nltk.download("ID")`` with a literal package id: ferry carries the package instead.
_NLTK_DOWNLOAD = re.compile(r"\bnltk\.download\(\s*(['\"])([\w.\-]+)\1\s*\)")
#: Top-level ``import X`` / ``from X import`` lines of a helper module.
_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)")
#: The packaged extra that carries lm-eval (pyproject.toml ``[project.optional-dependencies] eval``).
INSTALL_HINT = "pip install 'llm-ferry[eval]' (lm-evaluation-harness) on this host"


@dataclass(frozen=True)
class EvalTask:
    """One leaf task and the data it reads.

    ``repo_id`` / ``config`` / ``revision``: the hub dataset (``dataset_path``), its config (``dataset_name``,
    None for the repo's only one) and a pinned revision (``dataset_kwargs.revision``, else None = main); all
    None for a task over the user's own local files (``dataset_path: json`` with local ``data_files``), which
    ``eval:`` does not carry. ``version`` is the task's ``metadata.version``. ``nltk``: NLTK data package ids its
    helpers download (``punkt_tab``); ``requirements``: lm-eval's optional requirements its helpers import
    (``langdetect``, ``nltk>=3.9.1``), as lm-eval's metadata spells them.
    """

    name: str
    version: str | None
    repo_id: str | None
    config: str | None
    revision: str | None
    nltk: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()

    @property
    def cache_config(self) -> str:
        """The config folder ``datasets`` caches the load under (``default`` when the task names none)."""
        return self.config or "default"

    def describe(self) -> str:
        """``allenai/ai2_arc (ARC-Easy)`` or ``local files``."""
        if self.repo_id is None:
            return "local files"
        return f"{self.repo_id} ({self.config})" if self.config else self.repo_id


def task_manager(names: Sequence[str], include_path: str | os.PathLike | None = None) -> Any:
    """lm-eval's ``TaskManager`` over its built-in tasks and ``include_path``, after checking it knows every name.

    Raises:
        NotInstalledError: lm-eval is not installed.
        ConfigError: the first unknown task, group or tag, with up to three of lm-eval's closest names.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise NotInstalledError(f"evaluation tasks need lm-evaluation-harness: {INSTALL_HINT}") from None
    from bundler.eval_index import cached_builtin_index

    with cached_builtin_index():  # lm-eval's own index of its built-in tasks, read from ferry's cache
        manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f" (closest: {', '.join(near)})" if near else ""
            where = " or under include_path" if include_path is not None else "; custom tasks need include_path"
            raise ConfigError(f"unknown task {name!r}: not an lm-eval task{where}{hint}")
    return manager


def plan_eval_tasks(
    names: Sequence[str], include_path: str | os.PathLike | None = None, *, manager: Any = None
) -> list[EvalTask]:
    """The leaf tasks of ``names`` (tasks, groups, tags), each with the dataset it reads, in lm-eval's order.

    Nothing is downloaded and no task is built. ``manager``: a :func:`task_manager` already made (building its
    index takes lm-eval ~15 s).

    Raises:
        NotInstalledError: lm-eval is not installed.
        ConfigError: an unknown name; a task that would need the network at run time (the reason, one line).
    """
    manager = manager if manager is not None else task_manager(names, include_path)
    return [_classify(name, cfg) for name, cfg in _leaf_configs(manager, names).items()]


def _leaf_configs(manager: Any, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{leaf task name: its final config}`` as lm-eval's factory would build it (YAML ``!function`` tags are
    left as ``FOLDER/module.function`` strings, not imported)."""
    from lm_eval.tasks import _factory

    with _planning(manager, _factory):
        try:
            loaded = manager.load(list(names))
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"lm-eval cannot expand tasks {', '.join(names)}: {exc}") from None
    return {name: task.planned for name, task in loaded["tasks"].items()}


@contextmanager
def _planning(manager: Any, factory_module: Any) -> Iterator[None]:
    """Within the block, ``manager`` builds :class:`_Planned` stand-ins instead of tasks (lm-eval's groups keep
    only ``Task`` instances, so the stand-in subclasses ``ConfigurableTask`` without running its constructor)."""
    from lm_eval.api.task import ConfigurableTask

    class Planned(ConfigurableTask):
        def __init__(self, config: dict[str, Any]) -> None:  # no super(): that would download the dataset
            self.planned = dict(config)

        @property
        def task_name(self) -> str:
            return str(self.planned["task"])

    class PlanningFactory(factory_module.TaskFactory):
        def _load_full_config(self, entry: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
            if entry.yaml_path:
                cfg = deepcopy(factory_module.load_yaml(entry.yaml_path, resolve_func=False))
            else:
                cfg = deepcopy(entry.cfg or {})
            cfg = {**cfg, **(overrides or {})}
            cfg["__yaml__"] = str(entry.yaml_path) if entry.yaml_path else None
            return cfg

        def _build_task(self, entry: Any, overrides: dict[str, Any] | None) -> Any:
            return Planned(self._load_full_config(entry, overrides))

    saved_factory, saved_task = manager._factory, factory_module.ConfigurableTask
    manager._factory, factory_module.ConfigurableTask = PlanningFactory(meta=manager.metadata), Planned
    try:
        yield
    finally:
        manager._factory, factory_module.ConfigurableTask = saved_factory, saved_task


def _classify(name: str, cfg: dict[str, Any]) -> EvalTask:
    """The :class:`EvalTask` of one leaf config, or the one-line reason it would need the network.

    Raises:
        ConfigError: see the module docstring.
    """
    version = (cfg.get("metadata") or {}).get("version") if isinstance(cfg.get("metadata"), dict) else None
    version = None if version is None else str(version)
    if "class" in cfg:
        raise ConfigError(
            f"task {name!r} is a Python task class ({Path(str(cfg['class'])).name}): ferry cannot see what it "
            f"downloads, so it cannot carry it"
        )
    if cfg.get("custom_dataset"):
        raise ConfigError(
            f"task {name!r} builds its data with custom_dataset ({Path(str(cfg['custom_dataset'])).name}): ferry "
            f"cannot see what it reads, so it cannot carry it"
        )
    if cfg.get("process_results") is None:  # with process_results the task's own code scores every metric
        _check_metrics(name, cfg.get("metric_list") or [])
    nltk, requirements = _helper_needs(name, cfg)
    path = cfg.get("dataset_path")
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    if not isinstance(path, str) or not path:
        raise ConfigError(f"task {name!r} names no dataset_path")
    if path in PACKAGED_BUILDERS or Path(path).expanduser().is_absolute() or path.startswith("."):
        urls = [v for v in _strings(kwargs.get("data_files")) if "://" in v]
        if urls:
            raise ConfigError(f"task {name!r} reads {urls[0]} at run time: download it and name the local file")
        return EvalTask(name, version, None, None, None, nltk, requirements)
    if not _REPO_ID.match(path):
        raise ConfigError(
            f"task {name!r} reads dataset {path!r}, which is not ORG/NAME (a retired canonical name): ferry "
            f"carries hub repos by their ORG/NAME"
        )
    stray = sorted(set(kwargs) - _HUB_KWARGS)
    if stray:
        raise ConfigError(
            f"task {name!r} loads {path} with {', '.join(stray)}: the datasets cache ferry carries covers the "
            f"repo's own configs only"
        )
    config = cfg.get("dataset_name")
    revision = kwargs.get("revision")
    config = None if config is None else str(config)
    return EvalTask(name, version, path, config, revision and str(revision), nltk, requirements)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (nested dicts and lists: ``data_files`` forms)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _check_metrics(name: str, metric_list: list[Any]) -> None:
    """Refuse a metric name lm-eval does not register: it would be fetched with ``evaluate.load`` at run time."""
    import lm_eval.api.metrics  # noqa: F401  (fills the registry)
    from lm_eval.api.registry import metric_registry

    for entry in metric_list:
        metric = entry.get("metric") if isinstance(entry, dict) else None
        if not isinstance(metric, str) or _is_function(metric):  # the task's own code
            continue
        if entry.get("hf_evaluate") is True or metric not in metric_registry:
            raise ConfigError(
                f"task {name!r}: metric {metric!r} is not one of lm-eval's own; lm-eval would fetch it with "
                f"evaluate.load at run time"
            )


def _is_function(value: str) -> bool:
    """Whether ``value`` is an unresolved YAML ``!function`` reference (``/abs/FOLDER/module.function``)."""
    return value.startswith(os.sep) and len(value) < 1024 and re.fullmatch(r"[^\n]+\.\w+", value) is not None


def _helper_needs(name: str, cfg: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The NLTK packages and the optional lm-eval requirements a task's helper modules (the folders of its
    ``!function`` references) need: ``(("punkt_tab",), ("immutabledict", "langdetect", "nltk>=3.9.1"))``.

    Raises:
        ConfigError: a helper that would reach the network at run time (``file.py:LINE calls X()``).
    """
    refs = [Path(v) for key, value in cfg.items() if key != "__yaml__" for v in _strings(value) if _is_function(v)]
    folders = {ref.parent for ref in refs if (ref.parent / f"{ref.name.split('.')[0]}.py").is_file()}
    nltk: dict[str, None] = {}
    imported: set[str] = set()
    for folder in sorted(folders):
        for module in sorted(folder.glob("*.py")):
            if module.name.startswith("_generate"):  # lm-eval's config generators, not run by a task
                continue
            for number, line in enumerate(module.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                if found := _IMPORT.match(line):
                    imported.add(found.group(1))
                if literal := _NLTK_DOWNLOAD.search(line):
                    nltk[literal.group(2)] = None
                elif match := _NETWORK_CALLS.search(line):
                    raise ConfigError(
                        f"task {name!r} needs the network at run time: {module.name}:{number} calls {match.group(1)}()"
                    )
    optional = optional_requirements()
    wanted = sorted({optional[_normal(module)] for module in imported if _normal(module) in optional})
    return tuple(nltk), tuple(wanted)


def _normal(name: str) -> str:
    """A project or module name as PEP 503 normalises it (``Immutable_Dict`` -> ``immutable-dict``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def optional_requirements() -> dict[str, str]:
    """lm-eval's optional requirements (its extras, markers dropped) by normalised project name:
    ``{"langdetect": "langdetect", "nltk": "nltk>=3.9.1", ...}``; the first extra that names a project wins.
    Empty when lm-eval is not installed."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        lines = requires("lm-eval") or []
    except PackageNotFoundError:
        return {}
    found: dict[str, str] = {}
    for line in lines:
        spec, _, marker = line.partition(";")
        head = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._\-]*)", spec)
        if "extra" not in marker or head is None or "[" in spec:  # base requirements, and lm_eval[...] self-refs
            continue
        found.setdefault(_normal(head.group(1)), spec.strip())
    return found


def check_installed(tasks: Sequence[EvalTask]) -> None:
    """Refuse the first task whose hub dataset has no ``datasets`` cache on this host (``datasets.load_dataset``
    would fail offline after its retries, or reach for the network), or whose helpers' NLTK data is not on NLTK's
    data path. The cache folder is read from ``datasets.config.HF_DATASETS_CACHE`` (``HF_DATASETS_CACHE``, else
    ``HF_HOME/datasets``: ferry.env sets it, and ``NLTK_DATA``).

    Raises:
        NotInstalledError: naming the task, its dataset and config (or NLTK package), and the ``ferry pack --eval``
            that carries it.
    """
    import datasets

    from bundler.hub_datasets import cache_folder_name

    root = Path(datasets.config.HF_DATASETS_CACHE)
    for task in tasks:
        for package_id in task.nltk:
            if not _nltk_installed(package_id):
                raise NotInstalledError(
                    f"task {task.name!r} needs NLTK data {package_id!r}, which is not installed (not in NLTK_DATA or "
                    f"NLTK's own folders; lm-eval would download it): pack it with `ferry pack --eval {task.name}` "
                    f"and install the bundle"
                )
        if task.repo_id is None:
            continue
        folder = root / cache_folder_name(task.repo_id) / task.cache_config
        if not folder.is_dir():
            raise NotInstalledError(
                f"task {task.name!r} reads {task.describe()}, which is not installed (no datasets cache "
                f"{folder}): pack it with `ferry pack --eval {task.name}` and install the bundle"
            )


def _nltk_installed(package_id: str) -> bool:
    """Whether NLTK's data path (``NLTK_DATA`` first, then its own folders) holds package ``package_id``, unzipped
    (``SUBDIR/ID/``) or zipped (``SUBDIR/ID.zip``): what ``nltk.data.find("SUBDIR/ID")`` finds."""
    try:
        import nltk
    except ImportError:
        return False
    for root in nltk.data.path:
        folder = Path(str(root))
        if folder.is_dir() and (any(folder.glob(f"*/{package_id}/")) or any(folder.glob(f"*/{package_id}.zip"))):
            return True
    return False


def lm_eval_requirement() -> str:
    """``lm-eval==X`` for the lm-eval installed here: the target runs the task YAMLs the plan was made from.

    Raises:
        NotInstalledError: lm-eval is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"lm-eval=={version('lm-eval')}"
    except PackageNotFoundError:
        raise NotInstalledError(f"evaluation tasks need lm-evaluation-harness: {INSTALL_HINT}") from None


def _by_repo(tasks: Sequence[EvalTask]) -> dict[str, list[EvalTask]]:
    """Hub tasks grouped by dataset repo, in first-seen order."""
    grouped: dict[str, list[EvalTask]] = {}
    for task in tasks:
        if task.repo_id is not None:
            grouped.setdefault(task.repo_id, []).append(task)
    return grouped


def nltk_needs(tasks: Sequence[EvalTask]) -> dict[str, list[str]]:
    """``{NLTK package id: the tasks whose helpers download it}``, in first-seen order."""
    needs: dict[str, list[str]] = {}
    for task in tasks:
        for package_id in task.nltk:
            needs.setdefault(package_id, []).append(task.name)
    return needs


def task_requirements(tasks: Sequence[EvalTask]) -> list[str]:
    """lm-eval's optional requirements the tasks' helpers import (``langdetect``), each once, sorted."""
    return sorted({req for task in tasks for req in task.requirements})


def eval_sources(tasks: Sequence[EvalTask], datasets: Sequence[SourceSpec]) -> list[SourceSpec]:
    """The ``hf:`` dataset sources the tasks need beyond ``datasets`` (the spec's own, which win when they name
    the same repo).

    Raises:
        ConfigError: two tasks pin one repo at different revisions; the spec carries a task's repo with
            ``datasets_cache: false`` (lm-eval's ``load_dataset`` needs that cache offline).
    """
    from bundler.spec import SourceSpec

    given = {src.repo_id: src for src in datasets if src.scheme == "hf"}
    added = []
    for repo_id, users in _by_repo(tasks).items():
        revisions = sorted({t.revision or "main" for t in users})
        if len(revisions) > 1:
            raise ConfigError(f"tasks {', '.join(t.name for t in users)} read {repo_id} at revisions {revisions}")
        if repo_id in given:
            if not given[repo_id].datasets_cache:
                raise ConfigError(
                    f"task {users[0].name!r} reads {repo_id} with datasets.load_dataset, which needs its datasets "
                    f"cache offline: drop datasets_cache: false from {given[repo_id].source}"
                )
            continue
        pin = users[0].revision
        added.append(SourceSpec(source=f"hf:{repo_id}@{pin}" if pin else f"hf:{repo_id}"))
    return added


def attach_eval_tasks(items: Sequence[PreparedItem], tasks: Sequence[EvalTask]) -> None:
    """Record on each packed dataset item the tasks that read it, after checking that its carried ``datasets``
    cache holds every config a task loads.

    Raises:
        ConfigError: a task's repo packed without a cache (the ``datasets`` library cannot read it: the reason),
            or without the config the task loads (the configs it has are named).
    """
    from bundler.format import DATASETS_CACHE_DIRNAME
    from bundler.hub_datasets import cache_folder_name

    items_by_repo = {item.repo_id: item for item in items if item.kind == "dataset" and item.source == "hf"}
    for repo_id, users in _by_repo(tasks).items():
        item = items_by_repo[repo_id]
        root = f"{DATASETS_CACHE_DIRNAME}/{cache_folder_name(repo_id)}/"
        configs = sorted({f.rel[len(root) :].split("/")[0] for f in item.files if f.rel.startswith(root)})
        for task in users:
            if not configs:
                why = "; ".join(item.notes) or "no datasets cache was built"
                raise ConfigError(f"task {task.name!r} cannot be carried: {why}")
            if task.cache_config not in configs:
                raise ConfigError(
                    f"task {task.name!r} loads config {task.cache_config!r} of {repo_id}, which has "
                    f"{', '.join(configs)}"
                )
        item.eval_tasks = [{"task": t.name, "config": t.config, "version": t.version} for t in users]


def describe_plan(tasks: Sequence[EvalTask], api: Any = None, nltk_index_url: str | None = None) -> list[str]:
    """Lines for ``ferry pack --dry-run``: each dataset repo with its commit and size on the hub (bytes of every
    file, from ``HfApi.list_repo_tree``), and the tasks that read it; each NLTK package with the size of its zip
    and the sha256 NLTK's index (``nltk_index_url``, default NLTK's own) states; nothing downloaded but the NLTK
    index. The ``datasets`` cache that ``ferry pack`` adds (about 1-2 x the parquet bytes) is not counted.

    Raises:
        SourceError: the hub or the NLTK index cannot be asked (the repo or package, and the answer).
    """
    from huggingface_hub import HfApi

    from ferry.errors import SourceError
    from ferry.fsutil import format_bytes

    api = api or HfApi()
    lines = []
    for repo_id, users in _by_repo(tasks).items():
        try:
            commit = api.repo_info(repo_id, repo_type="dataset", revision=users[0].revision or "main").sha or ""
            tree = api.list_repo_tree(repo_id, repo_type="dataset", revision=commit, recursive=True)
            size = sum(getattr(entry, "size", 0) or 0 for entry in tree)
        except Exception as exc:  # huggingface_hub's HTTP and repository errors: first line, naming the repo
            text = str(exc).strip().splitlines()
            raise SourceError(
                f"dataset {repo_id} of task {users[0].name!r}: {type(exc).__name__}: {text[0] if text else ''}"
            ) from None
        names = ", ".join(t.name for t in users)
        lines.append(f"eval      {repo_id}@{commit[:12]}  {format_bytes(size)}  tasks: {names}")
    if needs := nltk_needs(tasks):
        from bundler.nltk_data import describe_packages

        lines += describe_packages(needs, nltk_index_url)
    local = [t.name for t in tasks if t.repo_id is None]
    if local:
        lines.append(f"eval      local files (carry them as datasets yourself)  tasks: {', '.join(local)}")
    return lines


__all__ = [
    "EvalTask",
    "PACKAGED_BUILDERS",
    "attach_eval_tasks",
    "check_installed",
    "describe_plan",
    "eval_sources",
    "lm_eval_requirement",
    "nltk_needs",
    "plan_eval_tasks",
    "task_manager",
    "task_requirements",
]
