"""Install a verified bundle into a prefix: :func:`install_bundle` (stage, check, place) and :func:`install_staged`.

``python3 install.py --prefix DIR`` (bundler/installer/main.py) and ``ferry install`` (bundler/install.py, with a
progress bar) both call :func:`install_bundle`. Standard library and ferry's foundation only (part of the
generated ``install.py``).

What it writes, under ``PREFIX``::

    PREFIX/
    ├── ferry.env                              `source` it: FERRY_HOME, HF_HOME, MODELSCOPE_CACHE, PATH and
    │                                          every offline switch (HF_HUB_OFFLINE=1, ...)
    ├── hf-home/hub/                           a Hugging Face cache (huggingface_hub.scan_cache_dir lists it)
    │   ├── models--ORG--NAME/
    │   │   ├── blobs/<sha256>                 file contents, shared by every bundle holding the same bytes
    │   │   ├── snapshots/<revision>/<path>    relative symlinks ../../blobs/<sha256>
    │   │   └── refs/main, refs/<tag>          the resolved revision; refs/main only when main was packed
    │   └── datasets--ORG--NAME/               hub datasets, the same way (blobs: hard links of datasets/<name>)
    ├── hf-home/datasets/ORG___name -> ../../datasets/<name>/.ferry-datasets-cache/ORG___name
    │                                          the `datasets` Arrow cache ferry pack built: what
    │                                          datasets.load_dataset("ORG/NAME") reads offline
    ├── modelscope/models/ORG--NAME/snapshots/<revision>/   ModelScope models (MODELSCOPE_CACHE, modelscope-hub's
    │                                          layout; venvs get a hook that makes the SDK honour MODELSCOPE_OFFLINE)
    ├── datasets/
    │   ├── <name>/...                         one folder per dataset item (hub datasets: the repo's files and
    │   │                                      .ferry-datasets-cache/)
    │   └── dataset_info.json                  LLaMA-Factory's dataset registry (merged across bundles)
    ├── nltk_data/SUBDIR/ID/                   NLTK data packages (nltk.data.find("SUBDIR/ID"); NLTK_DATA)
    ├── venvs/<bundle_id>/                     one virtual environment per bundle with wheels
    ├── wheels/<sha256>                        every wheel and lock file installed (hard links of the staged
    │                                          files): what a delta bundle's unchanged wheels are taken from
    ├── tools/<file>                           serving tools carried in wheels/ (TOOL_FILES: llama.cpp's converter
    │                                          sdist for `ferry export --format gguf`)
    ├── venv -> venvs/<bundle_id>              swapped atomically when a new one is complete
    ├── venvs/<bundle_id>.engine-NAME/         a serving engine's own environment (wheels/engines/NAME/ and its
    ├── engines/NAME -> ../venvs/...           lock; `ferry serve --engine NAME` runs engines/NAME/bin/python)
    └── .ferry/                                install records: state.json, manifests/<bundle_id>.json, and while
                                               an install runs journal.json + replaced/ (folders swapped out)

Atomicity: everything is first extracted (or copied) into ``PREFIX/.staging-XXXX`` while hashing, then
checked against the manifest; nothing outside the staging directory changes before every byte is
verified. Content then moves in by renames: blobs are content-addressed (an orphan blob is harmless),
snapshot and dataset folders appear whole, the ``venv`` link, ``ferry.env`` and the install record switch
last; a folder swapped out stays in ``.ferry/replaced`` until then (:class:`bundler.installer.place.Journal`).
Installing the same bundle twice re-hashes what it installed and repairs missing or corrupt files; a second
bundle adds to the prefix.

Trust: every manifest field that reaches a path (bundle name and id, repo ids, revisions, item and file paths)
is validated (:func:`bundler.installer.manifest.validate_manifest`) before anything is written, by
``ferry verify`` and ``install.py`` alike, and every destination is resolved and proven to lie inside the
prefix (:func:`bundler.installer.plan.plan_install`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bundler.format import LOCK_NAME, POLICY_NAME
from bundler.installer.check import bundle_bytes, check_bundle
from bundler.installer.datasets import dataset_entries, merge_dataset_info, place_hf_dataset, taken_entries
from bundler.installer.delta import apply_delta, early_delta_check
from bundler.installer.fs import (
    PrefixLock,
    atomic_symlink,
    atomic_text,
    check_inside,
    clean_stray_temps,
    make_temp_dir,
    writable_prefix,
)
from bundler.installer.hashing import Progress
from bundler.installer.manifest import content_id, is_delta, manifest_digest, parse_manifest
from bundler.installer.modelscope import ms_offline_hook_files
from bundler.installer.place import (
    Journal,
    completing_command,
    interrupted_label,
    keep_wheels,
    place_hf,
    place_tree,
    read_journal,
)
from bundler.installer.plan import plan_install
from bundler.installer.prefix import engine_venvs, tool_files
from bundler.installer.records import load_state, render_env_file, same_content
from bundler.installer.report import say
from bundler.installer.scan import Scan
from bundler.installer.signature import check_prefix_policy, read_head, record_prefix_policy
from bundler.installer.venv import build_venv, check_target, hook_activate
from ferry.errors import BundleError, FerryError, InsufficientSpaceError, PrefixError
from ferry.faults import kill_point
from ferry.fsutil import PRIVATE_UMASK, SHARED_UMASK, ensure_free_space

#: Wheels unpack to roughly this many times their size in a venv (for the up-front free-space check).
WHEEL_EXPANSION = 3
#: A venv before any wheel (``python -m venv``, with pip): about 22 MiB on CPython 3.11, measured.
VENV_BASE_BYTES = 32 << 20


def _wheel_bytes(manifest: dict) -> int:
    return sum(f["size"] for item in manifest["items"] if item["kind"] == "wheels" for f in item["files"])


def install_staged(
    manifest: dict,
    staged: Path,
    prefix: Path,
    *,
    create_venv: bool = True,
    log: Callable[[str], None] = say,
    replace_datasets: bool = False,
    source: str | None = None,
    compile_bytecode: bool = True,
) -> dict:
    """Install a verified bundle staged at ``staged`` (the bundle folder inside ``PREFIX/.staging-XXXX``; that
    staging directory, on the same file system as ``prefix``, also holds temporary snapshot folders, and the
    caller removes it).

    Steps (after verification, which the caller did while staging): plan and check every destination
    (:func:`plan_install`), build the venv (when the bundle has wheels and ``create_venv``; its modules compiled to
    bytecode unless ``compile_bytecode`` is false), place models,
    ModelScope models and datasets (re-hashing what an earlier install placed: missing or corrupt files are
    repaired), keep the wheels in ``PREFIX/wheels`` (:func:`keep_wheels`), then switch ``PREFIX/venv``, write
    ``PREFIX/ferry.env``, hook ``activate``, record the bundle and its manifest in ``PREFIX/.ferry``
    (``state.json``, ``manifests/<bundle_id>.json``) and drop what was swapped out (:class:`Journal`, which
    names the bundle and ``source``, the path it is installed from). Returns a summary dict: ``{"bundle_id",
    "name", "models", "datasets", "venv", "already_installed", "repaired", "notes"}``.

    Raises:
        UnsafeArchiveError, BundleError: see :func:`plan_install`; nothing was written.
        BundleError: the bundle's wheels target another Python, venv creation or pip failed; a dataset entry
            of dataset_info.json is taken (without ``replace_datasets``).
    """
    prefix = Path(prefix).absolute()
    scratch = make_temp_dir("place-", staged.parent)
    state = load_state(prefix)
    plans = plan_install(manifest, prefix, state, replace_datasets=replace_datasets)
    already = manifest["bundle_id"] in state.get("bundles", {})
    summary: dict = {
        "bundle_id": manifest["bundle_id"],
        "name": manifest["name"],
        "models": [],
        "datasets": [],
        "venv": None,
        "already_installed": already,
        "notes": [],
        "repaired": [],
    }
    # Entries of dataset_info.json first: a name taken by other content is refused before anything moves.
    _check_dataset_entries(plans, staged, prefix, summary, replace_datasets)
    wheels = [i for i in manifest["items"] if i["kind"] == "wheels" and i["files"]]
    venv_dir = prefix / "venvs" / manifest["bundle_id"]
    engines = engine_venvs(wheels[0], prefix, manifest["bundle_id"]) if wheels else {}
    if wheels and create_venv:
        _build_bundle_venv(manifest, staged, wheels[0], venv_dir, log, compile_bytecode)
        _build_engines(engines, staged, wheels[0], log, compile_bytecode)
    _keep_wheels_and_tools(manifest, wheels, staged, prefix, summary)
    # Place: every item moves in by renames; what it replaces is kept by the journal until the commit.
    journal = Journal(prefix, bundle=manifest["name"], source=source, replace_datasets=replace_datasets)
    placing = _Placing(prefix, staged, scratch, state, already, journal, summary)
    for plan in plans:
        _place_item(plan, placing)
        kill_point("install:placed")  # one item in place (NAME#N: the N-th)
    if wheels and create_venv:
        summary["venv"] = _switch_venv(prefix, venv_dir, manifest["bundle_id"], journal)
        summary["engines"] = {
            name: _switch_engine(prefix, name, engine_dir, journal) for name, (_, engine_dir) in engines.items()
        }
    elif (prefix / "venv").exists():
        summary["venv"] = str(prefix / "venv")
    _write_env_file(prefix, journal)
    # Record: the manifest copy and state.json, then the journal's commit drops what was swapped out.
    _keep_manifest_copy(prefix, manifest)
    _record_bundle(state, manifest, plans, already, bool(wheels))
    _commit_state(prefix, state, journal)
    return summary


def _check_dataset_entries(
    plans: list[dict], staged: Path, prefix: Path, summary: dict, replace_datasets: bool
) -> None:
    """Read the dataset_info.json entries of every dataset plan (``plan["entries"]``; ``{}`` for the other plans,
    NLTK data registers nothing) and add their notes to ``summary``.

    Raises:
        BundleError: an entry already names other data in ``PREFIX/datasets/dataset_info.json`` and
            ``replace_datasets`` is not set (nothing was written).
    """
    info_path = prefix / "datasets" / "dataset_info.json"
    all_entries: dict = {}
    for plan in plans:
        plan.setdefault("entries", {})  # NLTK data registers nothing
        if plan["kind"] == "dataset":
            entries, notes = dataset_entries(plan["item"], plan["name"], staged / plan["item"]["path"])
            plan["entries"] = entries
            summary["notes"].extend(notes)
            all_entries.update(entries)
    taken = taken_entries(all_entries, info_path, plans, prefix, staged)
    if taken and not replace_datasets:
        raise BundleError(
            f"{info_path}: {'entry' if len(taken) == 1 else 'entries'} {', '.join(map(repr, taken))} "
            f"already {'names' if len(taken) == 1 else 'name'} other data: refused; install with --replace-datasets "
            "to replace them"
        )


def _build_engines(
    engines: dict[str, tuple[str, Path]], staged: Path, wheels: dict, log: Callable[[str], None], compile_bytecode: bool
) -> None:
    """Each serving engine in its own environment (:func:`engine_venvs`), installed with ``--no-deps`` (its lock
    leaves out what the pack excluded) by the uv its own lock or else the training set's lock carries."""
    for name, (lock, engine_dir) in engines.items():
        log(f"serving engine {name}: its own environment {engine_dir}")
        build_venv(
            engine_dir,
            (staged / "wheels" / lock).parent,
            staged / "wheels" / lock,
            log,
            compile_bytecode=compile_bytecode,
            no_deps=True,
            uv_from=_main_lock(staged, wheels),
        )
        kill_point("install:engine-venv")


def _main_lock(staged: Path, wheels: dict) -> tuple[Path, Path]:
    """The staged wheels folder of the training set and its lock (the wheels item's, else ``wheels/`` 's)."""
    lock = staged / wheels["path"] / LOCK_NAME
    if not lock.is_file():
        lock = staged / "wheels" / LOCK_NAME
    return staged / wheels["path"], lock


def _build_bundle_venv(
    manifest: dict,
    staged: Path,
    wheels: dict,
    venv_dir: Path,
    log: Callable[[str], None],
    compile_bytecode: bool = True,
) -> None:
    """Build ``venv_dir`` from the staged ``wheels`` item and its lock (:func:`build_venv`), after checking that
    the wheels run here, and give it the hook that makes the ModelScope SDK honour MODELSCOPE_OFFLINE.

    Raises:
        BundleError, InsufficientSpaceError: see :func:`check_target` and :func:`build_venv`.
    """
    check_target(manifest)
    build_venv(venv_dir, *_main_lock(staged, wheels), log, compile_bytecode=compile_bytecode)
    kill_point("install:venv")
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv_dir), "platbase": str(venv_dir)}))
    for file_name, text in ms_offline_hook_files().items():
        if not (purelib / file_name).is_file() or (purelib / file_name).read_text("utf-8") != text:
            atomic_text(purelib / file_name, text)


def _keep_wheels_and_tools(manifest: dict, wheels: list[dict], staged: Path, prefix: Path, summary: dict) -> None:
    """Keep the staged wheels in ``PREFIX/wheels/<sha256>`` (what a later delta bundle's from_base wheels are taken
    from; files repaired there go to ``summary["repaired"]``) and move the serving tools (ferry/serving_tools.py)
    into ``PREFIX/tools`` by rename."""
    if wheels:
        keep_wheels(wheels[0], staged / wheels[0]["path"], prefix, summary["repaired"])
    for name in tool_files(manifest):
        (prefix / "tools").mkdir(exist_ok=True)
        if os.path.isfile(staged / "wheels" / name):
            os.replace(staged / "wheels" / name, prefix / "tools" / name)


@dataclass
class _Placing:
    """What placing the items of one install shares: the prefix, the staged bundle, scratch space for snapshot
    folders (same file system), the install record read before placing, whether this bundle was installed
    before, the :class:`Journal` of the install and the summary being filled (:func:`install_staged`)."""

    prefix: Path
    staged: Path
    scratch: Path
    state: dict
    already: bool
    journal: Journal
    summary: dict


def _place_item(plan: dict, placing: _Placing) -> None:
    """Place one planned item (a ModelScope model, a hub model, a dataset or NLTK data), add it to the summary, and
    note a folder whose files were missing or corrupt among the repairs."""
    if plan["kind"] == "ms-model":
        _place_ms_model(plan, placing)
    elif plan["kind"] == "hf-model":
        item = plan["item"]
        placed = place_hf(
            item,
            placing.staged / item["path"],
            placing.prefix / "hf-home" / "hub",
            placing.scratch,
            reinstall=placing.already,
            journal=placing.journal,
        )
        placing.summary["repaired"].extend(placed.pop("repaired"))
        placing.summary["models"].append({"repo_id": item["repo_id"], "revision": item["revision"], **placed})
    else:
        _place_dataset(plan, placing)
    summary, item = placing.summary, plan["item"]
    if summary[("datasets" if plan["kind"] in ("dataset", "nltk") else "models")][-1].get("outcome") == "repaired":
        summary["repaired"].append(f"{item['repo_id']}: folder {plan['dest']} (files were missing or corrupt)")


def _place_ms_model(plan: dict, placing: _Placing) -> None:
    """Place a ModelScope model's folder; an earlier folder of the same model in an older layout is retired."""
    item, prefix, journal = plan["item"], placing.prefix, placing.journal
    earlier = (placing.state.get("items", {}).get(plan["key"]) or {}).get("path")
    outcome = place_tree(placing.staged / item["path"], plan["dest"], item, placing.state, plan["key"], journal)
    if earlier and Path(earlier) != plan["dest"] and os.path.isdir(earlier):
        # an older layout (models/ORG/NAME___), which the SDK reads first whatever revision is asked
        check_inside(os.path.realpath(prefix), Path(earlier), f"the earlier folder of {item['repo_id']}")
        journal.retire(Path(earlier))
    placing.summary["models"].append(
        {
            "repo_id": item["repo_id"],
            "revision": item["revision"],
            "path": str(plan["dest"]),
            "outcome": outcome,
        }
    )


def _place_dataset(plan: dict, placing: _Placing) -> None:
    """Place a dataset's (or NLTK data's) folder and merge its entries into ``PREFIX/datasets/dataset_info.json``;
    a hub dataset is also placed in the hub cache with its datasets cache linked (:func:`place_hf_dataset`)."""
    item, prefix, journal, summary = plan["item"], placing.prefix, placing.journal, placing.summary
    info_path = prefix / "datasets" / "dataset_info.json"
    if plan["entries"]:
        journal.keep(info_path)
    src = placing.staged / item["path"]
    outcome = place_tree(src, plan["dest"], item, placing.state, plan["key"], journal, repo_id=item["repo_id"])
    merge_dataset_info(info_path, plan["entries"])
    kill_point("install:dataset-info")
    summary["datasets"].append(
        {
            "name": plan["name"],
            "repo_id": item["repo_id"],
            "path": str(plan["dest"]),
            "outcome": outcome,
            "entries": sorted(plan["entries"]),
        }
    )
    if item["source"] == "hf":
        hub = place_hf_dataset(item, plan["dest"], prefix, placing.scratch, reinstall=placing.already, journal=journal)
        summary["repaired"].extend(hub.pop("repaired"))
        summary["notes"].extend(hub.pop("notes"))
        summary["datasets"][-1].update(hub)


def _switch_venv(prefix: Path, venv_dir: Path, bundle_id: str, journal: Journal) -> str:
    """Point ``PREFIX/venv`` at ``venvs/<bundle_id>`` (atomically, the link it replaces kept by ``journal``) and
    hook the venv's ``activate``; return the link's path."""
    link = prefix / "venv"
    want = os.path.join("venvs", bundle_id)
    if not (link.is_symlink() and os.readlink(link) == want):
        journal.keep(link)
        atomic_symlink(want, link)
        kill_point("install:venv-link")
    hook_activate(venv_dir, prefix)
    return str(link)


def _switch_engine(prefix: Path, name: str, engine_dir: Path, journal: Journal) -> str:
    """Point ``PREFIX/engines/NAME`` at the engine's environment (atomically, the link it replaces kept by
    ``journal``); return the link's path."""
    link = prefix / "engines" / name
    link.parent.mkdir(exist_ok=True)
    want = os.path.join("..", "venvs", engine_dir.name)
    if not (link.is_symlink() and os.readlink(link) == want):
        journal.keep(link)
        atomic_symlink(want, link)
        kill_point("install:engine-link")
    return str(link)


def _write_env_file(prefix: Path, journal: Journal) -> None:
    """Write ``PREFIX/ferry.env`` when its text changes (atomically, the file it replaces kept by ``journal``)."""
    env_text = render_env_file(prefix)
    env_file = prefix / "ferry.env"
    if not env_file.is_file() or env_file.read_text() != env_text:
        journal.keep(env_file)
        atomic_text(env_file, env_text)
        kill_point("install:env")


def _keep_manifest_copy(prefix: Path, manifest: dict) -> None:
    """Write ``PREFIX/.ferry/manifests/<bundle_id>.json`` once (what ``--verify-prefix`` checks against)."""
    manifest_copy = prefix / ".ferry" / "manifests" / f"{manifest['bundle_id']}.json"
    if not manifest_copy.is_file():
        atomic_text(manifest_copy, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def _record_bundle(state: dict, manifest: dict, plans: list[dict], already: bool, has_wheels: bool) -> None:
    """Record in ``state`` (in memory) the bundle (install time, manifest digest, whether its wheels are kept) and
    which bundle placed what: ``ferry verify --prefix`` checks each item against it."""
    bundles = state.setdefault("bundles", {})
    if not already:
        bundles[manifest["bundle_id"]] = {
            "name": manifest["name"],
            "installed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    bundles[manifest["bundle_id"]]["manifest_sha256"] = manifest_digest(manifest)
    if has_wheels:
        bundles[manifest["bundle_id"]]["wheel_store"] = True
    for plan in plans:
        key = plan.get("key") or f"hf-model:{plan['item']['repo_id']}@{plan['item']['revision']}"
        record = state.setdefault("items", {}).setdefault(
            key, {"revision": plan["item"]["revision"], "content": content_id(plan["item"]), "path": str(plan["dest"])}
        )
        if same_content(record, plan["item"]):
            record["bundle_id"] = manifest["bundle_id"]


def _commit_state(prefix: Path, state: dict, journal: Journal) -> None:
    """Write ``PREFIX/.ferry/state.json`` and commit ``journal`` (what was swapped out is dropped): from the
    journal's completing mark on, a kill leaves a complete install (:meth:`Journal.roll_back`)."""
    state_text = json.dumps(state, indent=2, sort_keys=True) + "\n"
    state_file = prefix / ".ferry" / "state.json"
    journal.completing(state_text)  # from here on a kill leaves a complete install (Journal.roll_back)
    if not state_file.is_file() or state_file.read_text("utf-8") != state_text:
        atomic_text(state_file, state_text)
    kill_point("install:state")
    journal.commit()


def _early_target_check(bundle: Path) -> None:
    """Refuse a bundle whose wheels cannot run here from its metadata head (a few hundred kB), before its
    payload is copied into staging; :func:`install_staged` checks again against the verified manifest."""
    try:
        head = read_head(bundle)
        manifest = parse_manifest(head["manifest"]) if head.get("manifest") else None
    except (BundleError, OSError):
        return  # not metadata-first, or unreadable: the full pass decides
    if manifest and any(i["kind"] == "wheels" and i["files"] for i in manifest["items"]):
        check_target(manifest)


def install_bundle(
    bundle: Path,
    prefix: Path,
    *,
    create_venv: bool = True,
    reference: Path | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = say,
    private: bool = False,
    replace_datasets: bool = False,
    allowed_signers: Path | None = None,
    require_signature: bool = False,
    compile_bytecode: bool = True,
) -> tuple[dict, Scan, dict]:
    """Verify and install ``bundle`` (a directory, archive or first volume) into ``prefix``.

    Every file is copied or extracted into ``PREFIX/.staging-XXXX`` while hashed (one read), checked against
    the manifest (every field validated, :func:`validate_manifest`), then installed by :func:`install_staged`.
    The staging directory is removed at the end, on success or failure; stale ones and stray temp files from
    killed runs are removed first, and an install killed half-way is rolled back (:class:`Journal`).
    A delta bundle (:func:`is_delta`) is completed in the staging directory by :func:`apply_delta` after its
    carried files are verified and before anything is placed: every ``from_base`` file must be in the prefix
    with its sha256, and ``tensors`` files are rebuilt and checked.
    What is written is readable by every account (directories 0755, files 0644, whatever the caller's umask),
    or with ``private`` by the installing account alone (0700 / 0600). ``compile_bytecode`` false leaves the venv's
    modules to be compiled when first imported (a faster install; the venv must then stay writable to keep the
    bytecode). Returns ``(manifest, scan, summary)``.

    Raises:
        PrefixError: the prefix cannot be created or written (read-only, another owner), in one line.
        InsufficientSpaceError: up front, when ``prefix`` cannot hold the bundle (plus its venv), or when the
            disk fills up part-way (another writer); nothing half-written is visible then either.
        IntegrityError / UnsafeArchiveError / BundleError: see :func:`check_bundle` and :func:`plan_install`;
            nothing was installed, nothing outside the prefix was touched.
        IntegrityError (one line): a delta's ``from_base`` file the prefix lacks or that drifted, a rebuilt
            file whose sha256 differs (:func:`apply_delta`); nothing was installed.
    """
    bundle = Path(bundle)
    prefix = Path(prefix).absolute()
    old_mask = os.umask(PRIVATE_UMASK if private else SHARED_UMASK)
    created = not os.path.lexists(prefix)
    try:
        writable_prefix(prefix)
        check_inside(os.path.realpath(prefix), prefix / ".ferry", "the prefix's .ferry folder")
        with PrefixLock(prefix):
            _before_staging(bundle, prefix, log, create_venv, allowed_signers, require_signature)
            staging = make_temp_dir(".staging-", prefix)
            try:
                tree = staging / "bundle"
                tree.mkdir()
                manifest, scan = check_bundle(bundle, reference, progress, dest=tree)
                check_prefix_policy(prefix, bundle, scan, tree, reference, allowed_signers, require_signature)
                summary = _install_checked(
                    manifest,
                    tree,
                    bundle,
                    prefix,
                    create_venv=create_venv,
                    log=log,
                    replace_datasets=replace_datasets,
                    compile_bytecode=compile_bytecode,
                )
                record_prefix_policy(prefix, allowed_signers)
            except OSError as exc:
                refused = _install_os_error(exc, bundle, prefix)
                if refused is None:
                    raise
                raise refused from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        if created:  # a refused first install leaves no empty prefix behind
            with contextlib.suppress(OSError):
                os.rmdir(prefix)
        raise
    finally:
        os.umask(old_mask)
    return manifest, scan, summary


def _before_staging(
    bundle: Path,
    prefix: Path,
    log: Callable[[str], None],
    create_venv: bool,
    allowed_signers: Path | None,
    require_signature: bool,
) -> None:
    """What :func:`install_bundle` does under the prefix lock before it stages anything: remove stray temp files,
    roll back an install killed half-way, check the free space for the bundle, and refuse from the metadata head
    what cannot install (wheels for another host; a delta whose base files the prefix lacks, when no signature is
    to be checked first).

    Raises:
        InsufficientSpaceError: ``prefix`` cannot hold the bundle.
        BundleError, IntegrityError: see :func:`check_target` and :func:`early_delta_check`.
    """
    clean_stray_temps(prefix)
    Journal(prefix).roll_back(log)
    needed = bundle_bytes(bundle)
    ensure_free_space(prefix, needed, f"installing {bundle.name}")
    if create_venv:
        _early_target_check(bundle)
    if not (allowed_signers or require_signature or (prefix / ".ferry" / POLICY_NAME).is_file()):
        early_delta_check(bundle, prefix)  # (with signers, the signature is checked first)


def _install_checked(
    manifest: dict,
    tree: Path,
    bundle: Path,
    prefix: Path,
    *,
    create_venv: bool,
    log: Callable[[str], None],
    replace_datasets: bool,
    compile_bytecode: bool = True,
) -> dict:
    """Install the verified bundle staged at ``tree``: complete a delta bundle from the prefix
    (:func:`apply_delta`), check the space its venv needs, then :func:`install_staged`, rolling the journal back
    at once when that fails. Returns install_staged's summary with ``"delta"`` (None for a full bundle).

    Raises:
        IntegrityError: see :func:`apply_delta`.
        InsufficientSpaceError: ``prefix`` cannot hold the venv.
        BundleError, UnsafeArchiveError: see :func:`install_staged`.
    """
    delta = None
    if is_delta(manifest):  # every from_base file checked in the prefix, before anything is placed
        delta = apply_delta(manifest, tree, prefix, log=log)
    kill_point("install:staged")
    if create_venv and _wheel_bytes(manifest):
        ensure_free_space(prefix, VENV_BASE_BYTES + WHEEL_EXPANSION * _wheel_bytes(manifest), "the bundle's venv")
    try:
        summary = install_staged(
            manifest,
            tree,
            prefix,
            create_venv=create_venv,
            log=log,
            replace_datasets=replace_datasets,
            source=str(bundle.absolute()),
            compile_bytecode=compile_bytecode,
        )
    except BaseException:  # a full disk, a signal: folders swapped out go back at once
        with contextlib.suppress(Exception):
            Journal(prefix).roll_back(log)
        raise
    summary["delta"] = delta
    return summary


def _install_os_error(exc: OSError, bundle: Path, prefix: Path) -> FerryError | None:
    """The one-line error an install of ``bundle`` raises instead of ``exc``: :class:`PrefixError` for a permission
    denied or a read-only file system, :class:`InsufficientSpaceError` for a full disk or quota; None when ``exc``
    goes up as it is (ferry's own errors, anything else)."""
    if isinstance(exc, PermissionError):
        return PrefixError(
            f"permission denied writing {exc.filename or prefix} while installing "
            f"{bundle.name}: the prefix or part of it belongs to another account or is "
            f"read-only"
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, FerryError):
        return InsufficientSpaceError(
            f"ran out of disk space in {prefix} while installing {bundle.name} ({exc}); what is "
            f"already in place is complete and nothing half-written is visible: free some space and "
            f"run the install again"
        )
    if exc.errno == errno.EROFS and not isinstance(exc, FerryError):
        return PrefixError(f"{prefix} is on a read-only file system")
    return None


def recover_interrupted_install(prefix: Path, log: Callable[[str], None] = say) -> bool:
    """Put back what an install that was killed part-way swapped out of ``prefix`` (its :class:`Journal`), so
    that the prefix again holds what its install record says. The commands that read an installed prefix call
    this first; ``ferry install`` does it under its own lock. An install killed after it wrote its install record
    is only cleaned up. Returns True when there was an interrupted install to finish.

    Raises:
        PrefixError: an install is swapping folders in ``prefix`` right now, or this account cannot write the
            prefix to restore it; the line names the interrupted bundle and the command that completes it.
        BundleError: the journal is unreadable (named).
    """
    prefix = Path(prefix).absolute()
    journal = read_journal(prefix)
    if journal is None:
        return False
    what, rerun = interrupted_label(journal), completing_command(journal, prefix)
    if not os.access(prefix / ".ferry", os.W_OK):
        raise PrefixError(
            f"{prefix}: {what} was interrupted before it completed, and this account cannot put the earlier "
            f"install back: the installing account runs `{rerun}`"
        )
    try:
        lock = PrefixLock(prefix).__enter__()
    except BundleError:
        raise PrefixError(
            f"{prefix}: {what} is replacing folders right now: run this again when it has finished"
        ) from None
    try:
        clean_stray_temps(prefix)
        outcome = Journal(prefix).roll_back(log)
    finally:
        lock.__exit__(None, None, None)
    if outcome == "restored":  # (None: the install that held the journal completed in the meantime)
        log(f"{prefix}: the earlier install is back in place; `{rerun}` completes the interrupted one")
    return outcome is not None
