"""lm-eval's index of its built-in tasks, cached by ferry: the same entries lm-eval builds, read back from the cache."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("lm_eval")

from bundler.eval_index import CACHE_SUBDIR, _key  # noqa: E402
from bundler.eval_tasks import task_manager  # noqa: E402
from tests.support.helpers import share_lm_eval_index  # noqa: E402

pytestmark = pytest.mark.budget(120, reason="builds lm-eval's own index of its ~14,000 task YAMLs (about 12 s a build)")


def _entries(manager) -> dict:
    return {k: (e.name, e.kind, e.yaml_path, e.cfg, e.tags) for k, e in manager.task_index.items()}


@pytest.fixture(scope="module")
def lm_evals_own():
    """lm-eval's TaskManager made as lm-eval makes it (no ferry cache around it)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def test_the_cached_index_is_lm_evals_own_and_is_read_back(lm_evals_own, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path))
    first = task_manager(["arc_easy", "mmlu"])
    (cached,) = (tmp_path / CACHE_SUBDIR).glob("*.json")
    second = task_manager(["arc_easy", "mmlu"])
    for manager in (first, second):
        assert _entries(manager) == _entries(lm_evals_own)
        assert manager.all_groups == lm_evals_own.all_groups and manager.all_tags == lm_evals_own.all_tags
        assert manager.all_subtasks == lm_evals_own.all_subtasks
    from lm_eval.tasks import _index

    assert isinstance(_index.TaskIndex.__dict__["build"], staticmethod)  # lm-eval's own builder put back
    calls = []

    def counting(paths, **kw):
        # lm-eval's builder, counted; it answers with the index it built above (a fourth build would add ~16 CPU-s)
        calls.append(list(paths))
        return dict(lm_evals_own.task_index)

    monkeypatch.setattr(_index.TaskIndex, "build", staticmethod(counting))
    task_manager(["arc_easy"])
    assert calls == []  # read from the cache: lm-eval's builder was not called
    cached.write_text('[{"name": "arc_easy", "kind": "NOT_A_KIND"')  # unreadable: built again, rewritten
    rebuilt = task_manager(["arc_easy"])
    assert len(calls) == 1 and _entries(rebuilt) == _entries(lm_evals_own)
    assert cached.read_text().startswith("[{") and cached.stat().st_size > 1_000_000
    reread = task_manager(["arc_easy"])  # the rewritten cache is read back whole
    assert len(calls) == 1 and _entries(reread) == _entries(lm_evals_own)


def test_an_include_path_task_overrides_a_built_in_name_as_in_lm_eval(lm_evals_own, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    # the built-in tasks from the machine's shared index (the test above proves it is lm-eval's own)
    monkeypatch.setenv("FERRY_CACHE", str(share_lm_eval_index(tmp_path / "cache")))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "arc_easy.yaml").write_text(
        "task: arc_easy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: x.jsonl\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: [a, b]\ndoc_to_target: 0\n"
    )
    ours = task_manager(["arc_easy"], tasks)
    theirs = TaskManager(include_path=str(tasks))
    assert ours.task_index["arc_easy"].yaml_path == tasks / "arc_easy.yaml"
    assert _entries(ours) == _entries(theirs)


def test_the_key_changes_with_a_changed_task_file(tmp_path):
    folder = tmp_path / "tasks"
    (folder / "sub").mkdir(parents=True)
    task = folder / "sub" / "t.yaml"
    task.write_text("task: t\n")
    before = _key(folder)
    assert _key(folder) == before
    task.write_text("task: t2\n")
    os.utime(task, ns=(1, 1))
    changed = _key(folder)
    (folder / "u.yaml").write_text("task: u\n")
    assert len({before, changed, _key(folder)}) == 3
    # the same files, mtimes and all, in another install (uv links one copy into every venv): its own key,
    # since the entries name YAML files by absolute path
    other = tmp_path / "other-venv" / "tasks"
    shutil.copytree(folder, other)  # copy2: sizes and mtimes kept
    assert _key(other) != _key(folder)
