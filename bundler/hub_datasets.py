"""The ``datasets`` library's Arrow cache of a Hugging Face dataset repo, built by ``ferry pack``.

Why: with ``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``), ``datasets.load_dataset("ORG/NAME")`` (datasets
2.16 to 5.x, read in ``datasets/load.py``: ``dataset_module_factory`` raises ``OfflineModeIsEnabled`` before
any hub call, then falls back to ``CachedDatasetModuleFactory``) never reads the huggingface_hub cache
(``hub/datasets--ORG--NAME/snapshots``): it loads only what an earlier online ``load_dataset`` left in
``HF_DATASETS_CACHE`` (default ``$HF_HOME/datasets``)::

    HF_DATASETS_CACHE/
    └── ORG___name/                        ``name`` = camelcase_to_snakecase(NAME)
        └── CONFIG/0.0.0/COMMIT/           one folder per config (``default`` without README ``configs``)
            ├── dataset_info.json          features, splits, row counts
            └── name-SPLIT.arrow           (``name-SPLIT-00000-of-0000N.arrow`` when sharded)

(``datasets.packaged_modules.cache``; the ``revision`` argument is not consulted offline: the newest cached
folder is used.) ``ferry pack`` therefore builds that folder for every config of the repo from the files it
packed (the same builder, data files and config names that an online load of the repo at that commit uses) and
carries it inside the dataset item under ``.ferry-datasets-cache/``; ``install.py`` links
``PREFIX/hf-home/datasets/ORG___name`` to it (``ferry.env`` sets ``HF_HOME``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bundler.format import DATASETS_CACHE_DIRNAME
from bundler.source_file import SourceFile

#: Files of a built cache folder that are carried (locks and ``.incomplete`` leftovers are not).
_CARRIED_SUFFIXES = (".arrow", ".json")


def cache_folder_name(repo_id: str) -> str:
    """``ORG___name`` for ``ORG/Name`` (``datasets``' ``DatasetBuilder._relative_data_dir``)."""
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = repo_id.split("/")
    return "___".join([*namespace, camelcase_to_snakecase(name)])


def build_arrow_cache(repo_id: str, commit: str, snapshot: Path, out: Path) -> tuple[list[SourceFile], str | None]:
    """Build the Arrow cache of the dataset repo ``repo_id`` at ``commit`` from its files in ``snapshot``.

    Every config of the repo (README ``configs``; ``default`` otherwise) is prepared with the builder that
    ``datasets`` infers from the files (parquet, json, csv, ...), exactly as an online
    ``load_dataset(repo_id, CONFIG, revision=commit)`` would cache it, into
    ``out/ORG___name/CONFIG/0.0.0/COMMIT/`` (a finished ``out`` from an earlier run is reused). Returns the
    files as item files under ``.ferry-datasets-cache/`` and None, or ``([], reason)`` when the ``datasets``
    library cannot read the repo (e.g. files of different columns, as in LLaMA-Factory's demo-data repo): then
    ``load_dataset("ORG/NAME")`` could not read it online either, and the item is packed without a cache.
    """
    folder = cache_folder_name(repo_id)
    done = out / ".complete"
    if not done.is_file():
        try:
            _build(repo_id, commit, snapshot, out, folder)
        except Exception as exc:  # the datasets library's own errors: one line, the item is packed without it
            shutil.rmtree(out, ignore_errors=True)
            return [], _root_cause(exc)
        done.write_text(commit + "\n")
    files = []
    for path in sorted((out / folder).rglob("*")):
        if path.is_file() and path.suffix in _CARRIED_SUFFIXES:
            rel = f"{DATASETS_CACHE_DIRNAME}/{path.relative_to(out).as_posix()}"
            files.append(SourceFile(rel, path, path.stat().st_size))
    return files, None


def _root_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost exception (datasets wraps the telling one)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _build(repo_id: str, commit: str, snapshot: Path, out: Path, folder: str) -> None:
    import datasets
    from datasets.load import dataset_module_factory, get_dataset_builder_class
    from datasets.naming import camelcase_to_snakecase

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".arrow-", dir=out.parent))
    try:
        datasets.disable_progress_bars()
        name = camelcase_to_snakecase(repo_id.split("/")[-1])
        module = dataset_module_factory(str(snapshot))
        builder_class = get_dataset_builder_class(module, dataset_name=name)
        kwargs = {k: v for k, v in module.builder_kwargs.items() if k != "dataset_name"}
        configs = [c.name for c in (module.builder_configs_parameters.builder_configs or [])] or [None]
        for config in configs:
            builder = builder_class(
                cache_dir=str(work / "cache"), dataset_name=name, config_name=config, hash=commit, **kwargs
            )
            builder.download_and_prepare()
        built = work / "cache" / name
        if not built.is_dir():
            raise RuntimeError(f"datasets wrote nothing under {work / 'cache'}")
        (work / "out").mkdir()
        built.rename(work / "out" / folder)
        (work / "out").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
