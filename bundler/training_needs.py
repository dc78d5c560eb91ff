"""What the training YAML a bundle is for (a spec's ``training_config``) needs from the bundle, added to the spec
or refused on the online host by ``bundler.spec.load_spec`` with these functions, before anything is downloaded::

    models     model_name_or_path and adapter_name_or_path, and for the preference stages ref_model and
               ref_model_adapters: a hub repo id (ORG/NAME, or hf:/ms:ORG/NAME) that no model of the spec
               carries is added as hf:ORG/NAME; local/NAME must be a local folder among the spec's models (the repo
               id a local folder installs under); a path (a folder there is on this host, or one with more than
               two parts) names a folder of the isolated host, say an adapter trained there, and is left alone
    datasets   for the preference stages (dpo, kto, rm) and a config without dataset_dir (the isolated host then
               reads the installed registry, $FERRY_HOME/datasets/dataset_info.json): every name in dataset and
               eval_dataset must be an entry the bundle installs (as the installer computes them: an entry of a
               dataset_info.json in a local folder of the spec's datasets whose file is there too, else one per
               data file, which declares no kind), of the kind the stage takes
               (ferry.stages.dataset_stage_problem: ranking for dpo and rm, columns.kto_tag for kto)

A config with ``dataset_dir`` names the isolated host's own data folder, which this host cannot see: its datasets
are not checked. The config's other keys are the trainer's to check on the isolated host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.errors import BundleError, ConfigError
from ferry.hub import REPO_ID_PATTERN
from ferry.stages import PREFERENCE_STAGES, dataset_stage_problem
from ferry.yaml_config import parse_yaml_mapping, read_config_text, split_names

#: The config keys that name models (or adapters) the run loads, by the stages that read them (None: every stage).
MODEL_KEYS: dict[str, tuple[str, ...] | None] = {
    "model_name_or_path": None,
    "adapter_name_or_path": None,
    "ref_model": PREFERENCE_STAGES,
    "ref_model_adapters": PREFERENCE_STAGES,
}
#: The config keys that name datasets.
DATASET_KEYS = ("dataset", "eval_dataset")


@dataclass(frozen=True)
class TrainingNeeds:
    """What one training config needs: ``stage``; ``models``, ``(key, repo_id)`` for each hub or ``local/``
    repo id it loads; ``datasets``, ``(key, name)`` for each dataset it names; ``dataset_dir`` as written (None
    when the config leaves it to the installed registry); ``quantizes``."""

    stage: str
    models: tuple[tuple[str, str], ...]
    datasets: tuple[tuple[str, str], ...]
    dataset_dir: str | None
    quantizes: bool = False  # quantization_bit is set (QLoRA): the bundle needs bitsandbytes


def _names(value: Any) -> list[str]:
    """A config value that holds one name, a comma-separated list or a YAML list, as a list of names."""
    names = split_names(value)
    if names is None:
        return []
    return [name for name in names if name] if isinstance(names, list) else [str(names)]


def _repo_id(name: str, base: Path) -> str | None:
    """``name`` as a repo id (``hf:``/``ms:`` prefix and ``@revision`` dropped), or None when it is a path: a
    folder or file that exists here (absolute, or relative to ``base`` or the working directory), or text that
    is no ``ORG/NAME``."""
    text = name[3:] if name.startswith(("hf:", "ms:")) else name
    text = text.split("@", 1)[0]
    if not name.startswith(("hf:", "ms:")):
        path = Path(name).expanduser()
        if path.exists() or (not path.is_absolute() and (base / path).exists()):
            return None
    return text if REPO_ID_PATTERN.match(text) else None


def read_training_needs(path: str | os.PathLike[str]) -> TrainingNeeds:
    """The :class:`TrainingNeeds` of the training YAML at ``path`` (LLaMA-Factory's keys, ferry's extras
    ignored). Paths in it are read relative to its folder.

    Raises:
        ConfigError: the file is missing, not UTF-8, not YAML or not a mapping (``training_config: ...``).
    """
    file = Path(path)
    try:
        data = parse_yaml_mapping(read_config_text(file), file)
    except ConfigError as exc:
        raise ConfigError(f"training_config: {exc}") from None
    stage = str(data.get("stage") or "sft")
    base = file.resolve().parent
    models = []
    for key, stages in MODEL_KEYS.items():
        if stages is not None and stage not in stages:
            continue
        for name in _names(data.get(key)):
            repo_id = _repo_id(name, base)
            if repo_id is not None:
                models.append((key, repo_id))
    datasets = tuple((key, name) for key in DATASET_KEYS for name in _names(data.get(key)))
    dataset_dir = data.get("dataset_dir")
    return TrainingNeeds(
        stage,
        tuple(models),
        datasets,
        None if dataset_dir is None else str(dataset_dir),
        quantizes=data.get("quantization_bit") is not None,
    )


def installed_entries(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """The ``dataset_info.json`` entries that installing the local dataset ``paths`` (folders or files) registers,
    by name, as the installer itself computes them (:func:`bundler.installer.datasets.dataset_entries`: a folder's
    own dataset_info.json, its entries whose file is carried; else one entry per data file); later items win, as
    at install.

    Raises:
        ConfigError: a dataset_info.json is not JSON, or one of its ``file_name`` values leaves its folder.
    """
    from bundler.installer.datasets import dataset_entries

    entries: dict[str, dict[str, Any]] = {}
    for path in paths:
        folder = path if path.is_dir() else path.parent
        files = [p for p in sorted(path.rglob("*")) if p.is_file()] if path.is_dir() else [path]
        item = {"source": "local", "files": [{"path": p.relative_to(folder).as_posix()} for p in files]}
        try:
            found, _ = dataset_entries(item, path.name, folder)
        except BundleError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        entries.update(found)
    return entries


def uses_images(needs: TrainingNeeds, folders: list[Path]) -> bool:
    """Whether a dataset the config names (``dataset``, ``eval_dataset``) is an entry the local dataset ``folders``
    install that declares an image or video column (LLaMA-Factory's ``columns.images`` / ``columns.videos``)."""
    if not needs.datasets:
        return False
    entries = installed_entries(folders)
    for _, name in needs.datasets:
        columns = (entries.get(name) or {}).get("columns")
        if isinstance(columns, dict) and (columns.get("images") or columns.get("videos")):
            return True
    return False


def check_datasets(needs: TrainingNeeds, folders: list[Path], where: str) -> None:
    """Refuse a preference config (``needs``, no ``dataset_dir``) whose datasets the local dataset ``folders`` of
    the bundle do not install, or whose kind its stage cannot use (:func:`ferry.stages.dataset_stage_problem`).
    Other stages and configs with ``dataset_dir`` pass.

    Raises:
        ConfigError: one line that starts with ``where`` and names the key and the dataset.
    """
    if needs.stage not in PREFERENCE_STAGES or needs.dataset_dir is not None:
        return
    entries = installed_entries(folders)
    for key, name in needs.datasets:
        entry = entries.get(name)
        if entry is None:
            raise ConfigError(
                f"{where}: {key}: {name!r} is not in the bundle, so stage: {needs.stage} would find no data on the "
                f"isolated host: add the folder that holds its dataset_info.json entry and its file to the spec's "
                f"datasets (or set dataset_dir to a data folder of the isolated host)"
            )
        columns = entry.get("columns")
        declared = [k for k, v in columns.items() if v] if isinstance(columns, dict) else []
        problem = dataset_stage_problem(needs.stage, entry.get("ranking") is True, declared)
        if problem is not None:
            raise ConfigError(f"{where}: {key}: dataset {name!r}: {problem}")


__all__ = ["TrainingNeeds", "check_datasets", "installed_entries", "read_training_needs", "uses_images"]
