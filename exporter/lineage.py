"""The lineage of an export: which base (as used, and as the adapter records it), which adapter, which training
config and datasets (with sha256 where the files are still found), written as ``ferry_export.json`` and as the
model card ``README.md``."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path
from typing import Any

from exporter.adapter import Adapter
from ferry.adapter_folder import TRAIN_CONFIG, TRAIN_REPORT
from ferry.fsutil import sha256_file


def _repo_id_of(folder: Path) -> str | None:
    """``ORG/NAME`` of an HF cache snapshot folder (``.../models--ORG--NAME/snapshots/<sha>``), else None."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return None


def _recorded_base_check(
    ad: Adapter, base_dir: Path, repo_id: str | None, commit: str | None
) -> tuple[dict[str, Any], str | None]:
    """Compare the base used with the one the adapter records (``base_model_name_or_path`` @ ``revision``).

    Returns ``({"repo_id", "revision"} as recorded, a warning or None)``. Same base: the recorded name resolves
    to the same folder, or names the same repo id; same commit: both known and equal (or one unknown).
    """
    from ferry.hub import resolve_model

    recorded = ad.config.get("base_model_name_or_path") or None
    rec_rev = ad.config.get("revision") or None
    info = {"repo_id": recorded, "revision": rec_rev}
    if not recorded:
        return info, None
    same = False
    with contextlib.suppress(Exception):
        candidate = Path(str(recorded)).expanduser()
        if not candidate.is_dir() and (ad.folder / str(recorded)).is_dir():
            candidate = ad.folder / str(recorded)
        folder = candidate.resolve() if candidate.is_dir() else resolve_model(recorded, revision=rec_rev)
        same = folder.resolve() == base_dir.resolve()
    names = {str(x).removeprefix("hf:").split("@")[0] for x in (repo_id, _repo_id_of(base_dir)) if x}
    if not same and str(recorded).removeprefix("hf:").split("@")[0] in names:
        same = rec_rev is None or commit is None or rec_rev == commit
        if not same:
            return info, (
                f"--base {repo_id} is at commit {commit} but the adapter was trained on {recorded} at "
                f"{rec_rev} (adapter_config.json revision): check that this is the model you mean"
            )
    if not same:
        return info, (
            f"--base {repo_id} is not the adapter's recorded base {recorded}"
            + (f"@{rec_rev}" if rec_rev else "")
            + " (adapter_config.json base_model_name_or_path): "
            "the shapes fit, but check that this is the model you mean"
        )
    return info, None


def _read_lineage(adapter: Adapter) -> dict[str, Any]:
    """Training config and dataset names / sha256 from the run folder around the adapter, when present."""
    lineage: dict[str, Any] = {"train_config": None, "train_config_text": None, "datasets": [], "eval": None}
    for folder in (adapter.folder, adapter.folder.parent):
        path = folder / TRAIN_CONFIG
        if path.is_file():
            import yaml

            text = path.read_text()
            lineage["train_config_text"] = text
            try:
                lineage["train_config"] = yaml.safe_load(text)
            except yaml.YAMLError:
                pass
            break
    names = []
    cfg = lineage["train_config"] if isinstance(lineage["train_config"], dict) else {}
    for key in ("dataset", "eval_dataset"):
        value = cfg.get(key)
        if isinstance(value, str):
            names += [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list):
            names += [str(v) for v in value]
    datasets: dict[str, str | list[str] | None] = {n: None for n in names}
    for folder in (adapter.folder, adapter.folder.parent):
        path = folder / TRAIN_REPORT
        if not path.is_file():
            continue
        try:
            report = json.loads(path.read_text())
        except ValueError:
            break
        found = report.get("datasets") if isinstance(report, dict) else None
        if isinstance(found, dict):
            found = [{"name": k, **(v if isinstance(v, dict) else {"sha256": v})} for k, v in found.items()]
        for item in found or []:
            if isinstance(item, dict) and item.get("name"):
                datasets[str(item["name"])] = item.get("sha256")
        lineage["eval"] = _eval_scores(report.get("eval") if isinstance(report, dict) else None)
        break
    for name, digest in datasets.items():
        if digest is None:
            datasets[name] = _dataset_sha256(name, cfg, adapter.folder.parent)
    lineage["datasets"] = [{"name": n, "sha256": s} for n, s in datasets.items()]
    return lineage


def _eval_scores(section: Any) -> dict[str, Any] | None:
    """The ``eval`` section a run's train_report.json holds after ``eval_tasks`` (evaluation's report: rows of
    task, metric, base, tuned, difference, stderr; task versions): rows and versions, or None when absent or not
    of that shape."""
    if not isinstance(section, dict) or not isinstance(section.get("rows"), list):
        return None
    keys = ("task", "metric", "base", "tuned", "difference", "stderr")
    rows = [{k: row.get(k) for k in keys} for row in section["rows"] if isinstance(row, dict) and row.get("task")]
    found = section.get("versions")
    versions = {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
    return {"rows": rows, "versions": versions} if rows else None


def _eval_lines(scores: dict[str, Any]) -> list[str]:
    """The model card's evaluation table (lm-evaluation-harness, base against the adapter it was exported from)."""

    def cell(value: Any, signed: bool = False) -> str:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return "-"
        return f"{value:+.4f}" if signed else f"{value:.4f}"

    lines = [
        "## Evaluation",
        "",
        "lm-evaluation-harness after training (`eval_tasks`), the base model against base + this adapter:",
        "",
        "| task | version | metric | base | tuned | diff | stderr |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in scores["rows"]:
        version = scores["versions"].get(str(row["task"]), "-")
        lines.append(
            f"| {row['task']} | {version} | {row['metric']} | {cell(row['base'])} | {cell(row['tuned'])} | "
            f"{cell(row['difference'], True)} | {cell(row['stderr'])} |"
        )
    return [*lines, ""]


def _dataset_sha256(name: str, cfg: dict[str, Any], run_dir: Path) -> str | list[str] | None:
    """sha256 of a training dataset's file(s) when they are still where the config says: a path given as the
    dataset name, or ``dataset_dir/dataset_info.json``'s ``file_name`` (LLaMA-Factory's registry). A relative
    ``dataset_dir`` is tried from the current directory and from the run folder's parent. None when not found."""
    dataset_dir = Path(str(cfg.get("dataset_dir") or "data"))
    roots = [dataset_dir] if dataset_dir.is_absolute() else [Path.cwd() / dataset_dir, run_dir.parent / dataset_dir]
    candidates: list[Path] = [Path(name)] if Path(name).is_absolute() else [Path.cwd() / name]
    for root in roots:
        info_path = root / "dataset_info.json"
        if info_path.is_file():
            try:
                entry = json.loads(info_path.read_text()).get(name)
            except ValueError:
                entry = None
            if isinstance(entry, dict) and entry.get("file_name"):
                candidates.insert(0, root / str(entry["file_name"]))
    for path in candidates:
        if path.is_file():
            return sha256_file(path)
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file())
            return [f"{sha256_file(f)}  {f.relative_to(path).as_posix()}" for f in files]
    return None


def _model_card(meta: dict[str, Any], lineage: dict[str, Any], license_id: str | None) -> str:
    base = meta["base"]
    title = Path(str(base["repo_id"] or base["path"])).name
    lines = ["---"]
    if base["repo_id"] and not Path(base["repo_id"]).is_absolute():
        lines.append(f"base_model: {base['repo_id']}")
    if license_id:
        lines.append(f"license: {license_id}")
    lines += [
        "library_name: " + ("peft" if meta["mode"] == "adapter-only" else "transformers"),
        "tags: [ferry, lora" + (", merged" if meta["mode"] == "merged" else "") + "]",
        "---",
        "",
    ]
    what = "LoRA adapter" if meta["mode"] == "adapter-only" else "merged model (base + LoRA adapter)"
    lines += [
        f"# {title} — {what}",
        "",
        f"Exported by ferry {meta['ferry_version']} on {meta['created']}.",
        "",
        "## Lineage",
        "",
        "| | |",
        "| --- | --- |",
        f"| base model | `{base['repo_id']}` |",
        f"| base commit | `{base['revision'] or 'unknown (local folder)'}` |",
        f"| adapter sha256 | `{meta['adapter']['sha256']}` ({meta['adapter']['file']}) |",
        f"| LoRA | r={meta['adapter']['r']}, lora_alpha={meta['adapter']['lora_alpha']}, "
        f"rslora={meta['adapter']['use_rslora']}, dora={meta['adapter']['use_dora']} |",
        f"| target modules | {meta['adapter']['target_modules']} |",
    ]
    recorded = base.get("recorded_by_adapter") or {}
    if recorded.get("repo_id") and (recorded.get("repo_id"), recorded.get("revision")) != (
        base["repo_id"],
        base["revision"],
    ):
        lines.append(f"| adapter's recorded base | `{recorded['repo_id']}` @ `{recorded.get('revision') or '-'}` |")
    if meta["mode"] == "merged":
        lines.append(f"| dtype | {meta['dtype']} |")
    lines.append("")
    if lineage["datasets"]:
        lines += ["## Training data", "", "| dataset | sha256 |", "| --- | --- |"]
        for d in lineage["datasets"]:
            digest = d["sha256"] if isinstance(d["sha256"], str) or d["sha256"] is None else "; ".join(d["sha256"])
            lines.append(f"| {d['name']} | `{digest or 'not recorded (files not found)'}` |")
        lines.append("")
    if lineage.get("eval"):
        lines += _eval_lines(lineage["eval"])
    if lineage["train_config_text"]:
        lines += ["## Training config", "", "```yaml", lineage["train_config_text"].rstrip(), "```", ""]
    lines += ["## Checksums", "", "Every file is listed in `SHA256SUMS`: `sha256sum -c SHA256SUMS`.", ""]
    return "\n".join(lines)


def _base_license(base_dir: Path) -> str | None:
    readme = base_dir / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(errors="replace")
    match = re.match(r"---\n(.*?)\n---", text, re.S)
    if match:
        found = re.search(r"^license:\s*(\S+)", match.group(1), re.M)
        return found.group(1).strip("'\"") if found else None
    return None


def _meta(
    ad: Adapter,
    mode: str,
    base_dir: Path | None,
    repo_id: str | None,
    commit: str | None,
    dtype: str | None,
    lineage: dict[str, Any],
) -> dict[str, Any]:
    from ferry import __version__

    cfg = ad.config
    return {
        "format": "ferry-export/1",
        "mode": mode,
        "ferry_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": {"repo_id": repo_id, "revision": commit, "path": str(base_dir) if base_dir else None},
        "adapter": {
            "path": str(ad.folder.resolve()),
            "file": ad.weights_file.name,
            "sha256": ad.sha256,
            "r": cfg.get("r"),
            "lora_alpha": cfg.get("lora_alpha"),
            "use_rslora": bool(cfg.get("use_rslora")),
            "use_dora": bool(cfg.get("use_dora")),
            "target_modules": cfg.get("target_modules"),
            "modules_to_save": cfg.get("modules_to_save"),
        },
        "dtype": dtype,
        "train_config": lineage["train_config"],
        "datasets": lineage["datasets"],
        "eval": lineage.get("eval"),
    }
