"""lm-eval's own tasks carried across the gap: ``ferry pack --eval``, ``ferry install``, ``ferry eval`` offline.

The olah hub (tests/support/hub.py) serves the two dataset repos that lm-eval's built-in ``arc_easy`` (multiple
choice) and ``gsm8k`` (generative, 5-shot) read, under their real names and with their real schema and configs
(``allenai/ai2_arc`` config ``ARC-Easy``; ``openai/gsm8k`` config ``main``), holding a few rows written here.
The tasks are lm-eval's own YAMLs, unchanged. The bundle is packed from the hub by naming the tasks only, then
installed, and ``ferry eval`` runs with no network at all (``unshare -rn``), ``ferry.env`` sourced. The goldens
are lm-eval's own CLI, online against the same hub, on the same model and adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from bundler.eval_tasks import plan_eval_tasks, task_manager  # noqa: E402
from bundler.install import install  # noqa: E402
from bundler.pack import pack  # noqa: E402
from bundler.spec import load_spec  # noqa: E402
from bundler.verify import verify  # noqa: E402
from ferry.errors import ConfigError, IntegrityError, NotInstalledError  # noqa: E402
from tests.support.evalrun import ferry_eval_offline, lm_eval_cli_cached, lm_eval_online, online_env  # noqa: E402
from tests.support.helpers import EVAL_IMPORTS, parquet_bytes, run_ferry, set_online_env  # noqa: E402
from tests.support.hub import DEFAULT_LFS, serve_hub  # noqa: E402
from tests.support.lora import random_adapter  # noqa: E402

pytestmark = pytest.mark.budget(
    90, reason="pack and install tasks, then ferry eval offline beside lm-eval's CLI online"
)

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["arc_easy", "gsm8k"]
LIMIT = 3

ARC_CARD = """---
license: cc-by-sa-4.0
configs:
- config_name: ARC-Easy
  data_files:
  - split: train
    path: ARC-Easy/train-*.parquet
  - split: validation
    path: ARC-Easy/validation-*.parquet
  - split: test
    path: ARC-Easy/test-*.parquet
---
"""
GSM_CARD = """---
license: mit
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
---
"""
ARC_ROWS = [
    ("Lily went to the park. Where did Lily go?", ["the park", "the moon", "a box", "the sea"], "A"),
    ("The cat was very sleepy. What did the cat do?", ["ran", "slept", "sang", "swam"], "B"),
    ("Tom had a red ball. What color was the ball?", ["blue", "green", "red", "white"], "C"),
    ("The sun was hot. How was the sun?", ["cold", "wet", "small", "hot"], "D"),
    ("Ben saw a big dog. What did Ben see?", ["a fish", "a dog", "a tree", "a car"], "B"),
]
GSM_ROWS = [
    (f"Tom has {a} apples and gets {b} more. How many apples does he have?", a + b)
    for a, b in [(2, 3), (4, 1), (5, 5), (7, 2), (1, 8), (3, 3), (6, 4), (9, 0)]
]


#: A task of the user's own over a JSONL file named relative to the YAML, carried as a local dataset folder.
MY_TASK = """task: my_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _arc(rows: list[tuple]) -> bytes:
    return parquet_bytes(
        [
            {"id": f"q{i}", "question": q, "choices": {"text": c, "label": list("ABCD")}, "answerKey": key}
            for i, (q, c, key) in enumerate(rows)
        ]
    )


def _gsm(rows: list[tuple]) -> bytes:
    return parquet_bytes([{"question": q, "answer": f"{q.split()[2]} + more = {n}\n#### {n}"} for q, n in rows])


@pytest.fixture(scope="module")
def carried(tmp_path_factory, stories_model):
    """The hub with both repos; bundle ``evalkit`` packed by naming the tasks, installed into ``prefix`` (no
    venv); a LoRA adapter on stories260K. Yields the paths and the hub."""
    root = tmp_path_factory.mktemp("eval-pack")
    lfs = (*DEFAULT_LFS, "*.parquet")
    with serve_hub(root / "hub") as hub:
        hub.add_dataset(
            "allenai/ai2_arc",
            {
                "README.md": ARC_CARD,
                "ARC-Easy/train-00000-of-00001.parquet": _arc(ARC_ROWS),
                "ARC-Easy/validation-00000-of-00001.parquet": _arc(ARC_ROWS[:2]),
                "ARC-Easy/test-00000-of-00001.parquet": _arc(ARC_ROWS[::-1]),
            },
            lfs=lfs,
        )
        hub.add_dataset(
            "openai/gsm8k",
            {
                "README.md": GSM_CARD,
                "main/train-00000-of-00001.parquet": _gsm(GSM_ROWS),
                "main/test-00000-of-00001.parquet": _gsm(GSM_ROWS[::-2]),
            },
            lfs=lfs,
        )
        my_tasks = root / "my_tasks"
        (my_tasks / "data").mkdir(parents=True)
        (my_tasks / "my_mc.yaml").write_text(MY_TASK)
        rows = [{"question": q, "choices": c, "answer": "ABCD".index(k)} for q, c, k in ARC_ROWS]
        (my_tasks / "data" / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        spec = load_spec(name="evalkit", eval_tasks=TASKS, datasets=[str(my_tasks)], no_wheels=True)
        with pytest.MonkeyPatch.context() as mp:
            set_online_env(mp, hub, root / "hf-home-packer")
            result = pack(spec, root / "out", progress=False)
        prefix = root / "prefix"
        install(root / "out" / "evalkit.ferry.tar", prefix, create_venv=False)
        adapter = random_adapter(stories_model, root / "adapter")
        yield {
            "root": root,
            "hub": hub,
            "result": result,
            "prefix": prefix,
            "adapter": adapter,
            "model": stories_model,
            "my_tasks": my_tasks,
        }


def _ferry_eval_offline(carried: dict, out: Path, tasks: list[str], *extra: str) -> subprocess.CompletedProcess:
    return ferry_eval_offline(carried["prefix"], carried["root"], carried["model"], out, tasks, LIMIT, *extra)


def _lm_eval_online(carried: dict, out: Path, peft: bool) -> dict:
    """lm-eval's own CLI, online against the hub, on the same model, adapter, tasks, limit."""
    model_args = f"pretrained={carried['model']}" + (f",peft={carried['adapter']}" if peft else "")
    inputs = {"model": carried["model"], **({"adapter": carried["adapter"]} if peft else {})}
    return lm_eval_online(carried["hub"], out, model_args, TASKS, LIMIT, inputs=inputs)


@pytest.fixture(scope="module")
def ferry_run(carried) -> dict:
    out = carried["root"] / "ferry-out"
    proc = _ferry_eval_offline(carried, out, TASKS, "--adapter-name-or-path", str(carried["adapter"]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"proc": proc, "out": out}


def test_pack_carries_each_tasks_dataset_with_its_cache_and_names_the_tasks(carried):
    items = {i["repo_id"]: i for i in carried["result"].manifest["items"]}
    assert set(items) == {"allenai/ai2_arc", "openai/gsm8k", "local/my_tasks"}
    assert "eval_tasks" not in items["local/my_tasks"]
    arc, gsm = items["allenai/ai2_arc"], items["openai/gsm8k"]
    assert arc["eval_tasks"] == [{"task": "arc_easy", "config": "ARC-Easy", "version": "1.0"}]
    assert gsm["eval_tasks"] == [{"task": "gsm8k", "config": "main", "version": "3.0"}]
    cache = f".ferry-datasets-cache/allenai___ai2_arc/ARC-Easy/0.0.0/{arc['revision']}/"
    assert {e["path"] for e in arc["files"]} >= {cache + f"ai2_arc-{s}.arrow" for s in ("train", "validation", "test")}
    assert arc["license"] == "cc-by-sa-4.0" and gsm["license"] == "mit"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["base", "tuned"])
def test_offline_eval_of_lm_evals_own_tasks_equals_its_cli_online(carried, ferry_run, which):
    golden = _lm_eval_online(carried, carried["root"] / f"golden-{which}", peft=which == "tuned")
    ours = json.loads((ferry_run["out"] / which / "results.json").read_text())
    for task in TASKS:
        assert ours["results"][task] == golden["results"][task], task
        assert ours["versions"][task] == golden["versions"][task]
        assert (
            ours["n-samples"][task]
            == golden["n-samples"][task]
            == {"original": 5 if task == "arc_easy" else 4, "effective": LIMIT}
        )
    assert "acc,none" in ours["results"]["arc_easy"] and "exact_match,strict-match" in ours["results"]["gsm8k"]


@pytest.mark.slow
def test_a_task_whose_dataset_was_not_packed_is_one_line_naming_task_and_dataset(carried):
    out = carried["root"] / "not-packed"
    proc = _ferry_eval_offline(carried, out, ["arc_challenge"])
    assert proc.returncode == NotInstalledError.exit_code, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ferry: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "task 'arc_challenge' reads allenai/ai2_arc (ARC-Challenge), which is not installed" in errors[0]
    assert "ferry pack --eval arc_challenge" in errors[0]
    assert not out.exists()


@pytest.mark.slow
def test_a_task_folder_carried_in_the_bundle_runs_where_it_was_installed(carried):
    """The user's task YAML names its data relative to itself; installed under PREFIX/datasets/, evaluated offline
    from another working directory: the scores lm-eval's CLI gives in the original folder."""
    installed = carried["prefix"] / "datasets" / "my_tasks"
    assert (installed / "my_mc.yaml").read_text() == MY_TASK
    out = carried["root"] / "my-tasks-eval"
    proc = _ferry_eval_offline(carried, out, ["my_mc"], "--include-path", str(installed))
    assert proc.returncode == 0, proc.stderr[-4000:]
    golden_out = carried["root"] / "my-tasks-golden"
    args = ["--model", "hf", "--model_args", f"pretrained={carried['model']}"]
    args += ["--tasks", "my_mc", "--include_path", ".", "--limit", str(LIMIT), "--batch_size", "1", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(golden_out / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    inputs = {"model": carried["model"], "tasks": carried["my_tasks"]}  # lm-eval run in the task folder
    golden = lm_eval_cli_cached(args, golden_out, env, inputs, cwd=carried["my_tasks"])
    ours = json.loads((out / "base" / "results.json").read_text())["results"]["my_mc"]
    assert ours == golden["results"]["my_mc"]
    assert (installed / "my_mc.yaml").read_text() == MY_TASK  # the installed folder is left as it was


def test_a_corrupt_carried_dataset_cache_fails_verification_naming_the_file(carried, tmp_path):
    import shutil

    bundle = tmp_path / "evalkit"
    shutil.copytree(carried["root"] / "out" / "evalkit", bundle)
    (arrow,) = [p for p in bundle.rglob("ai2_arc-test.arrow")]
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"ai2_arc-test\.arrow"):
        verify(bundle)


def test_dry_run_lists_the_tasks_their_datasets_and_sizes_downloading_nothing(carried, tmp_path):
    hub = carried["hub"]
    before = hub.requests_for("/resolve/")
    env = online_env()
    env.update(hub.env(), HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(ROOT))
    args = ["pack", "--dry-run", "--no-wheels", "--eval", "gsm8k", "--eval", "arc_easy"]
    proc = run_ferry(args, env=env, cwd=tmp_path, preload=EVAL_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval")]
    arc = next(i for i in carried["result"].manifest["items"] if i["repo_id"] == "allenai/ai2_arc")
    hub_bytes = sum(e["size"] for e in arc["files"] if not e["path"].startswith(".ferry-datasets-cache/"))
    assert lines[0].split()[1].startswith("openai/gsm8k@") and lines[0].endswith("tasks: gsm8k")
    assert lines[1].split()[1] == f"allenai/ai2_arc@{arc['revision'][:12]}" and lines[1].endswith("tasks: arc_easy")
    from ferry.fsutil import format_bytes

    assert f"  {format_bytes(hub_bytes)}  " in lines[1]
    assert hub.requests_for("/resolve/") == before
    assert not any(tmp_path.glob("*.ferry.tar"))


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    """lm-eval's TaskManager over its own tasks and two custom YAMLs that would need the network."""
    tasks = tmp_path_factory.mktemp("net-tasks")
    common = "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: [a, b]\ndoc_to_target: 0\n"
    (tasks / "url_task.yaml").write_text(
        "task: url_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        "    test: https://example.org/data/test.jsonl\n" + common
    )
    (tasks / "evaluate_task.yaml").write_text(
        "task: evaluate_task\ndataset_path: acme/qa\n" + common + "metric_list:\n  - metric: bleurt\n"
    )
    (tasks / "kwargs_task.yaml").write_text(
        "task: kwargs_task\ndataset_path: acme/qa\ndataset_kwargs:\n  data_dir: sub\n" + common
    )
    (tasks / "helper.py").write_text(
        "import nltk\n\nPACKAGE = 'punkt'\nnltk.download(PACKAGE)\n\n\n"
        "def score(doc, results):\n    return {'acc': 1.0}\n"
    )
    (tasks / "nltk_var_task.yaml").write_text(
        "task: nltk_var_task\ndataset_path: acme/qa\nprocess_results: !function helper.score\n" + common
    )
    return task_manager([], tasks)


@pytest.mark.parametrize(
    "task,message",
    [
        ("nltk_var_task", "task 'nltk_var_task' needs the network at run time: helper.py:4 calls nltk.download()"),
        ("squadv2", "task 'squadv2' is a Python task class (task.SQuAD2): ferry cannot see what it downloads"),
        ("url_task", "task 'url_task' reads https://example.org/data/test.jsonl at run time"),
        ("evaluate_task", "task 'evaluate_task': metric 'bleurt' is not one of lm-eval's own; lm-eval would fetch"),
        ("kwargs_task", "task 'kwargs_task' loads acme/qa with data_dir: the datasets cache ferry carries covers"),
    ],
)
def test_a_task_that_would_need_the_network_is_refused_in_one_line(manager, task, message):
    with pytest.raises(ConfigError) as info:
        plan_eval_tasks([task], manager=manager)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_groups_expand_to_their_leaf_tasks_with_lm_evals_configs(manager):
    mmlu = plan_eval_tasks(["mmlu"], manager=manager)
    assert len(mmlu) == 57 and {t.repo_id for t in mmlu} == {"cais/mmlu"}
    assert ("mmlu_anatomy", "anatomy") in {(t.name, t.config) for t in mmlu}
    (arc,) = plan_eval_tasks(["arc_easy"], manager=manager)
    assert (arc.repo_id, arc.config, arc.revision, arc.version) == ("allenai/ai2_arc", "ARC-Easy", None, "1.0")


def test_the_wheel_set_gains_lm_eval_as_installed_here():
    from importlib.metadata import version

    from bundler.eval_tasks import lm_eval_requirement
    from bundler.wheels import wheel_requirements

    assert lm_eval_requirement() == f"lm-eval=={version('lm-eval')}"
    spec = load_spec(name="k", eval_tasks=["arc_easy", "gsm8k", "arc_easy"])
    assert spec.eval == ["arc_easy", "gsm8k"]
    plain = wheel_requirements(load_spec(name="k"))
    assert wheel_requirements(spec) == [*plain, f"lm-eval=={version('lm-eval')}"]
    assert not any(r.startswith("lm-eval") for r in plain)
    spec.add_eval_requirements(["langdetect", "nltk>=3.9.1"])
    spec.add_eval_requirements(["langdetect"])
    assert wheel_requirements(spec) == [*plain, f"lm-eval=={version('lm-eval')}", "langdetect", "nltk>=3.9.1"]
    with pytest.raises(ConfigError, match="eval: Value error, an empty task name"):
        load_spec(name="k", eval_tasks=["arc_easy", " "])
