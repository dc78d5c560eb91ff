"""``ferry eval`` against lm-evaluation-harness itself, on the real stories260K Llama and a LoRA adapter.

The goldens are lm-eval's own CLI runs (``python -m lm_eval ...``) on the same model, adapter and task YAMLs:
a multiple-choice task, a generative task and a rolling-perplexity task in lm-eval's own format, each reading a
local JSONL (``dataset_path: json``). ferry's run happens with no network at all (``unshare -rn``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from evaluation.config import load_eval_config  # noqa: E402
from ferry.errors import ConfigError, RegressionError  # noqa: E402
from tests.support.evalrun import lm_eval_cli_cached  # noqa: E402
from tests.support.helpers import run_ferry_eval, run_ferry_train, worker_env, write_config  # noqa: E402
from tests.support.lora import random_adapter  # noqa: E402

pytestmark = pytest.mark.budget(
    150, reason="ferry eval and lm-eval's own CLI on the same tasks, each a process that loads lm-eval and the model"
)

ROOT = Path(__file__).resolve().parents[2]
GPUS = __import__("torch").cuda.device_count()
MORE_RANKS_THAN_GPUS = max(2, GPUS + 1)
TASKS = ["ferry_mc", "ferry_gen", "ferry_ppl"]
LIMIT = 4

MC_ROWS = [
    {
        "question": "Lily went to the park. Where did Lily go?",
        "choices": ["the park", "the moon", "a box"],
        "answer": 0,
    },
    {"question": "The cat was very sleepy. What did the cat do?", "choices": ["ran", "slept", "sang"], "answer": 1},
    {"question": "Tom had a red ball. What color was the ball?", "choices": ["blue", "green", "red"], "answer": 2},
    {"question": "The sun was hot. How was the sun?", "choices": ["hot", "cold", "wet"], "answer": 0},
    {"question": "Ben saw a big dog. What did Ben see?", "choices": ["a fish", "a dog", "a tree"], "answer": 1},
]
GEN_ROWS = [
    {"prompt": "Once upon a time, there was a little", "answer": " girl"},
    {"prompt": "One day, Lily went to the", "answer": " park"},
    {"prompt": "The dog was very", "answer": " happy"},
    {"prompt": "Tom and his mom", "answer": " went"},
    {"prompt": 'She said, "Thank', "answer": " you"},
]
PPL_ROWS = [
    {"text": "Once upon a time, there was a little girl named Lily. She loved to play outside."},
    {"text": "One day, a big dog came to the park. The dog was very friendly and wanted to play."},
    {"text": "Tom had a red ball. He threw the ball to his friend, and they laughed together."},
    {"text": "The sun was hot, so they sat under a tree and ate their lunch in the shade."},
    {"text": "At night, the moon was bright. Lily looked at the stars and made a wish."},
]

TASK_YAMLS = {
    "ferry_mc": """task: ferry_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "ferry_gen": """task: ferry_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "ferry_ppl": """task: ferry_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def assets(tmp_path_factory, stories_model) -> dict[str, Path]:
    """The task folder (three YAMLs over local JSONL files) and a LoRA adapter on stories260K with random B."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "data"
    data.mkdir()
    _jsonl(data / "mc.jsonl", MC_ROWS)
    _jsonl(data / "gen.jsonl", GEN_ROWS)
    _jsonl(data / "ppl.jsonl", PPL_ROWS)
    tasks = root / "tasks"
    tasks.mkdir()
    for name, text in TASK_YAMLS.items():
        (tasks / f"{name}.yaml").write_text(text.format(data=data))
    random_adapter(stories_model, root / "adapter")
    return {"root": root, "tasks": tasks, "adapter": root / "adapter", "model": stories_model}


def _env(root: Path) -> dict[str, str]:
    """The environment of a subprocess: this checkout first on the path, caches inside the test's folder."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HOME"] = str(root / "hf-home")
    env["HF_DATASETS_CACHE"] = str(root / "hf-datasets")
    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # ferry and lm-eval's CLI sum log-likelihoods in the same order, under xdist or not
    return env


def _ferry_eval(
    assets: dict[str, Path], out: Path, *extra: str, offline: bool = True, model: Path | None = None
) -> subprocess.CompletedProcess:
    args = ["--model-name-or-path", str(model or assets["model"]), "--tasks", ",".join(TASKS)]
    args += ["--include-path", str(assets["tasks"]), "--limit", str(LIMIT), "--output-dir", str(out), *extra]
    return run_ferry_eval(*args, env=_env(assets["root"]), cwd=ROOT, offline=offline)


@pytest.fixture(scope="module")
def ferry_run(assets) -> dict:
    """``ferry eval`` of the base and base + adapter, with no network; the gate set so that it passes."""
    out = assets["root"] / "ferry-out"
    proc = _ferry_eval(assets, out, "--adapter-name-or-path", str(assets["adapter"]), "--max-drop", "1e9")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"proc": proc, "out": out, "report": json.loads((out / "report.json").read_text())}


def _lm_eval_cli(assets: dict[str, Path], out: Path, peft: bool) -> dict:
    """lm-eval's own CLI on the same model (and adapter), tasks and limit: its results JSON (cached per machine by
    content: :func:`tests.support.evalrun.lm_eval_cli_cached`)."""
    model_args = f"pretrained={assets['model']}" + (f",peft={assets['adapter']}" if peft else "")
    args = ["--model", "hf", "--model_args", model_args, "--tasks", ",".join(TASKS)]
    args += ["--include_path", str(assets["tasks"]), "--limit", str(LIMIT), "--batch_size", "1", "--device", "cpu"]
    inputs = {"model": assets["model"], "tasks": assets["tasks"], "data": assets["root"] / "data"}
    if peft:
        inputs["adapter"] = assets["adapter"]
    return lm_eval_cli_cached(args, out, _env(assets["root"]), inputs)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["base", "tuned"])
def test_ferry_eval_gives_exactly_the_metrics_of_lm_evals_own_cli(assets, ferry_run, which):
    golden = _lm_eval_cli(assets, assets["root"] / f"golden-{which}", peft=which == "tuned")["results"]
    ours = json.loads((ferry_run["out"] / which / "results.json").read_text())["results"]
    for task in TASKS:
        assert ours[task] == golden[task], task
    assert {"acc,none", "acc_norm,none"} <= set(ours["ferry_mc"])
    assert "exact_match,none" in ours["ferry_gen"]
    assert "bits_per_byte,none" in ours["ferry_ppl"]


def test_only_ferrys_lines_reach_the_terminal_and_the_libraries_write_to_the_log(ferry_run):
    # lm-eval's progress bars and warnings, the weights' loading bars: output_dir/logs/libraries.log
    shown = ferry_run["proc"].stderr
    assert "\r" not in shown and "it/s" not in shown, shown[-3000:]
    assert [line for line in shown.splitlines() if line.strip() and not line.startswith("ferry")] == [], shown[-3000:]
    log = (ferry_run["out"] / "logs" / "libraries.log").read_text()
    assert "lm_eval" in log, log[-3000:]


@pytest.mark.slow
def test_two_ranks_give_the_scores_of_one(assets, ferry_run):
    """``--nproc-per-node 2`` (torchrun, gloo, no network): lm-eval's requests split over two ranks, gathered on
    rank 0, the same scores as one process. Counts and accuracies are equal; log-probability sums within 1e-6
    (each rank runs on half the cores, and fp32 matmuls sum in another order with another thread count)."""
    out = assets["root"] / "two-ranks"
    proc = _ferry_eval(assets, out, "--adapter-name-or-path", str(assets["adapter"]), "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for which in ("base", "tuned"):
        one = json.loads((ferry_run["out"] / which / "results.json").read_text())
        two = json.loads((out / which / "results.json").read_text())
        for task in TASKS:
            assert two["n-samples"][task] == one["n-samples"][task]
            assert two["results"][task].keys() == one["results"][task].keys()
            for key, value in one["results"][task].items():
                logprob_sum = isinstance(value, float) and ("perplexity" in key or "per_byte" in key)
                close = pytest.approx(value, rel=1e-6) if logprob_sum else value
                assert two["results"][task][key] == close, (which, task, key)
    rows_one, rows_two = ferry_run["report"]["rows"], json.loads((out / "report.json").read_text())["rows"]
    assert [(r["task"], r["metric"]) for r in rows_two] == [(r["task"], r["metric"]) for r in rows_one]
    assert [r["tuned"] for r in rows_two] == pytest.approx([r["tuned"] for r in rows_one], rel=1e-6)
    assert proc.stdout.splitlines()[0].split() == ["task", "metric", "base", "tuned", "diff", "stderr"]


@pytest.mark.slow
def test_the_merged_export_scores_as_the_adapter(assets, ferry_run):
    """``ferry export`` of the adapter, evaluated as a plain model: the tuned model's scores (counts and
    accuracies equal; log-probability sums within 1e-5: W + BA merged in fp32 rounds otherwise than W x + B(A x))."""
    from exporter.export import export

    merged = assets["root"] / "merged"
    export(assets["adapter"], merged)
    out = assets["root"] / "export-eval"
    proc = _ferry_eval(assets, out, model=merged)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tuned = json.loads((ferry_run["out"] / "tuned" / "results.json").read_text())
    exported = json.loads((out / "base" / "results.json").read_text())
    for task in TASKS:
        assert exported["n-samples"][task] == tuned["n-samples"][task]
        for key, value in tuned["results"][task].items():
            if key == "alias":
                continue
            logprob_sum = isinstance(value, float) and ("perplexity" in key or "per_byte" in key)
            assert exported["results"][task][key] == (pytest.approx(value, rel=1e-5) if logprob_sum else value), key
    base = json.loads((ferry_run["out"] / "base" / "results.json").read_text())
    assert exported["results"]["ferry_ppl"]["bits_per_byte,none"] != base["results"]["ferry_ppl"]["bits_per_byte,none"]


TRAINED_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.slow
def test_apply_chat_template_renders_with_the_adapters_trained_template(assets, tmp_path):
    """The adapter's chat_template.jinja (what ferry train writes) is the template, as if the base model's folder
    had it: lm-eval's own CLI with --apply_chat_template on such a folder gives the same scores."""
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(assets["adapter"], adapter)
    (adapter / "chat_template.jinja").write_text(TRAINED_TEMPLATE)
    out = tmp_path / "ours"
    extra = ("--adapter-name-or-path", str(adapter), "--apply-chat-template", "--tasks", "ferry_mc")
    proc = _ferry_eval(assets, out, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = tmp_path / "model-with-template"
    shutil.copytree(assets["model"], model)
    (model / "chat_template.jinja").write_text(TRAINED_TEMPLATE)
    args = ["--model", "hf", "--model_args", f"pretrained={model},peft={adapter}", "--tasks", "ferry_mc"]
    args += ["--include_path", str(assets["tasks"]), "--limit", str(LIMIT), "--batch_size", "1", "--device", "cpu"]
    args += ["--apply_chat_template"]
    inputs = {"model": model, "adapter": adapter, "tasks": assets["tasks"], "data": assets["root"] / "data"}
    theirs = lm_eval_cli_cached(args, tmp_path / "golden", _env(assets["root"]), inputs)
    ours = json.loads((out / "tuned" / "results.json").read_text())
    assert ours["results"]["ferry_mc"] == theirs["results"]["ferry_mc"]
    assert ours["chat_template"] == theirs["chat_template"] == TRAINED_TEMPLATE
    assert ours["chat_template_sha"] == theirs["chat_template_sha"]
    assert json.loads((out / "base" / "results.json").read_text())["chat_template"] == TRAINED_TEMPLATE


@pytest.mark.slow
def test_the_offline_run_writes_both_results_the_report_and_prints_the_table(ferry_run):
    out = ferry_run["out"]
    assert sorted(p.name for p in out.iterdir()) == ["base", "logs", "report.json", "report.md", "tuned"]
    header = ferry_run["proc"].stdout.splitlines()[0].split()
    assert header == ["task", "metric", "base", "tuned", "diff", "stderr"]
    rows = ferry_run["report"]["rows"]
    assert {(r["task"], r["metric"]) for r in rows} >= {("ferry_mc", "acc"), ("ferry_ppl", "bits_per_byte")}
    assert (out / "report.md").read_text().startswith("| task | metric | base | tuned | diff | stderr |")
    assert ferry_run["report"]["regressions"] == []


@pytest.mark.slow
def test_the_adapter_changes_the_scores_and_the_gate_names_the_task_that_fell(assets, ferry_run):
    rows = {(r["task"], r["metric"]): r for r in ferry_run["report"]["rows"]}
    bpb = rows[("ferry_ppl", "bits_per_byte")]
    assert bpb["base"] != bpb["tuned"]
    assert bpb["tuned"] > bpb["base"]  # random LoRA noise: the tuned model is worse, by a margin the gate sees
    assert not bpb["higher_is_better"]
    out = assets["root"] / "gate-fails"
    proc = _ferry_eval(
        assets,
        out,
        "--adapter-name-or-path",
        str(assets["adapter"]),
        "--max-drop",
        "ferry_ppl=0,ferry_mc=1,ferry_gen=1",
        offline=False,
    )
    assert proc.returncode == RegressionError.exit_code
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("ferry: error: ferry_ppl: ")
    assert "more than max_drop 0" in line
    assert "bits_per_byte" in line and "ferry_mc" not in line
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("ferry: error:")] == [line]
    assert json.loads((out / "report.json").read_text())["regressions"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--tasks", "ferry_mcq"],
            "unknown task 'ferry_mcq': not an lm-eval task or under include_path (closest: ferry_mc",
        ),
        (  # two ranks: the ranks check the tasks, the launcher says what one process says
            ["--tasks", "ferry_mcq", "--nproc-per-node", "2"],
            "unknown task 'ferry_mcq': not an lm-eval task or under include_path (closest: ferry_mc",
        ),
        (
            ["--adapter-name-or-path", "/nonexistent/adapter"],
            "adapter_name_or_path '/nonexistent/adapter': no such folder",
        ),
        (  # more ranks than this host's GPUs (none here)
            ["--nproc-per-node", str(MORE_RANKS_THAN_GPUS), "--device", "cuda"],
            f"nproc_per_node {MORE_RANKS_THAN_GPUS} on device cuda needs {MORE_RANKS_THAN_GPUS} GPUs (one per rank); "
            f"torch sees {GPUS}",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(assets, tmp_path, extra, message):
    out = tmp_path / "out"
    args = ["--model-name-or-path", str(assets["model"]), "--tasks", "ferry_mc"]
    args += ["--include-path", str(assets["tasks"]), "--output-dir", str(out), *extra]
    proc = run_ferry_eval(*args, env=_env(assets["root"]), cwd=ROOT, timeout=300)
    assert proc.returncode == ConfigError.exit_code, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ferry: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert not out.exists()


def test_an_unknown_config_key_is_one_line_naming_it(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text("model_name_or_path: m\ntasks: a\noutput_dir: o\nnum_fewshots: 5\n")
    proc = run_ferry_eval(str(config), env=_env(tmp_path), cwd=ROOT, timeout=120)
    assert proc.returncode == ConfigError.exit_code
    assert proc.stderr.strip().splitlines() == [
        f"ferry: error: {config}: unknown key 'num_fewshots' (did you mean 'num_fewshot'?)"
    ]
    assert not (tmp_path / "o").exists()


def test_the_config_reads_task_lists_and_both_spellings_of_max_drop(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text("model_name_or_path: m\ntasks: [a, b]\noutput_dir: o\nmax_drop: {a: 0.02}\nlimit: 10\n")
    cfg = load_eval_config(config)
    assert cfg.tasks == ["a", "b"] and cfg.drop_for("a") == 0.02 and cfg.drop_for("b") is None
    assert cfg.lm_eval_limit() == 10 and isinstance(cfg.lm_eval_limit(), int)
    flags = load_eval_config(config, {"tasks": "a, c", "max_drop": "0.5", "limit": "0.25"})
    assert flags.tasks == ["a", "c"] and flags.drop_for("c") == 0.5 and flags.lm_eval_limit() == 0.25
    assert load_eval_config(config, {"max_drop": "a=0.1,b=0"}).max_drop == {"a": 0.1, "b": 0.0}
    with pytest.raises(ConfigError, match=r"--limit: key 'limit': .*\(got '2.5'\)"):
        load_eval_config(config, {"limit": "2.5"})
    with pytest.raises(ConfigError, match="missing required key 'output_dir'"):
        load_eval_config(None, {"model_name_or_path": "m", "tasks": "a"})


def test_the_gate_reads_each_metrics_direction_and_only_the_tasks_it_names():
    """A rise in perplexity is a drop, a rise in accuracy is not; rows follow lm-eval's ``NAME,FILTER`` keys."""
    from evaluation.report import EvalReport, compare, regressions

    def results(acc: float, ppl: float) -> dict:
        return {
            "results": {
                "qa": {"alias": "qa", "acc,none": acc, "acc_stderr,none": 0.1, "exact_match,strict": acc},
                "lm": {"alias": "lm", "word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A"},
            },
            "higher_is_better": {"qa": {"acc": True, "exact_match": True}, "lm": {"word_perplexity": False}},
        }

    rows = compare(results(0.5, 10.0), results(0.6, 12.0))
    by_key = {(r.task, r.metric): r for r in rows}
    assert set(by_key) == {("qa", "acc"), ("qa", "exact_match,strict"), ("lm", "word_perplexity")}
    assert by_key[("qa", "acc")].drop == pytest.approx(-0.1) and by_key[("qa", "acc")].stderr == 0.1
    assert by_key[("lm", "word_perplexity")].drop == pytest.approx(2.0)
    assert by_key[("lm", "word_perplexity")].stderr is None
    assert regressions(rows, lambda task: 0.0) == [
        "lm: word_perplexity fell by 2.0000 (base 10.0000, tuned 12.0000), more than max_drop 0"
    ]
    assert regressions(rows, lambda task: 2.5) == []
    assert regressions(rows, {"qa": 0.0}.get) == []
    with pytest.raises(RegressionError, match=r"^lm: word_perplexity fell by 2\.0000"):
        EvalReport(rows=rows, regressions=regressions(rows, lambda task: 1.0)).raise_for_regressions()
    alone = EvalReport(rows=compare(results(0.5, 10.0), None))
    assert alone.table().splitlines()[0].split() == ["task", "metric", "value", "stderr"]
    assert alone.regressions == [] and all(r.drop is None for r in alone.rows)


def test_llamafactorys_old_eval_yaml_maps_to_lm_eval_tasks_with_one_line(tmp_path, caplog):
    """The keys of LLaMA-Factory's evaluation YAML (its harness, removed in 0.9.5): task NAME_SPLIT, n_shot, lang,
    template, save_dir, finetuning_type; and every other key its eval parser takes."""
    config = tmp_path / "lf_eval.yaml"
    lf = (
        "model_name_or_path: models/base\nadapter_name_or_path: saves/lora/sft\nfinetuning_type: lora\n"
        "task: {task}\ntemplate: fewshot\nlang: {lang}\nn_shot: 5\nsave_dir: saves/lora/eval\nbatch_size: 4\n"
    )
    expected = {"mmlu_test": "mmlu", "cmmlu_test": "cmmlu", "ceval_validation": "ceval-valid"}
    for task, ours in expected.items():
        config.write_text(lf.format(task=task, lang="en" if task == "mmlu_test" else "zh"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferry.evaluation"):
            cfg = load_eval_config(config)
        assert (cfg.tasks, cfg.num_fewshot, cfg.output_dir, cfg.batch_size) == ([ours], 5, "saves/lora/eval", 4)
        assert cfg.adapter_name_or_path == "saves/lora/sft"
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"LLaMA-Factory eval keys: task: {task} -> tasks: {ours}; n_shot: 5 -> num_fewshot;")
        assert "ignored: lang (the task fixes its language), template (" in line
    assert load_eval_config(config, {"num_fewshot": "0"}).num_fewshot == 0  # a flag still wins
    config.write_text(lf.format(task="mmlu_validation", lang="en"))
    with pytest.raises(ConfigError, match=r"task 'mmlu_validation' has no lm-eval equivalent here; known: mmlu_test"):
        load_eval_config(config)
    config.write_text(lf.format(task="mmlu_test", lang="en").replace("lora", "full"))
    with pytest.raises(ConfigError, match="finetuning_type: full: ferry eval evaluates a base and a LoRA adapter"):
        load_eval_config(config)
    # every other key of LLaMA-Factory's eval parser is taken without a word (its ModelArguments, DataArguments,
    # FinetuningArguments at any value), but for those that would evaluate another model
    extra = "dataset_dir: data\ncutoff_len: 4096\ninfer_dtype: bfloat16\nlora_rank: 16\nuse_fast_tokenizer: false\n"
    config.write_text(lf.format(task="mmlu_test", lang="en") + extra)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferry.evaluation"):
        assert load_eval_config(config).tasks == ["mmlu"]
    assert "dataset_dir" not in caplog.text and "cutoff_len" not in caplog.text
    config.write_text(lf.format(task="mmlu_test", lang="en") + "quantization_bit: 4\n")
    with pytest.raises(ConfigError, match=r"lf_eval.yaml: quantization_bit: 4: LLaMA-Factory loads the model"):
        load_eval_config(config)
    config.write_text(lf.format(task="mmlu_test", lang="en") + "lora_rnak: 8\n")
    with pytest.raises(ConfigError, match="unknown key 'lora_rnak'"):
        load_eval_config(config)


def _train_config(assets: dict[str, Path], data: Path, out: Path, **keys) -> dict:
    """Two LoRA steps on LLaMA-Factory's alpaca_en_demo, then lm-eval's scores of base and adapter."""
    return {
        "model_name_or_path": str(assets["model"]),
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(data),
        "template": "default",
        "cutoff_len": 64,
        "max_samples": 8,
        "lora_rank": 4,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "max_steps": 2,
        "save_strategy": "no",
        "output_dir": str(out),
        "report_to": "none",
        "disable_tqdm": True,
        "eval_tasks": "ferry_mc,ferry_ppl",
        "eval_include_path": str(assets["tasks"]),
        "eval_limit": LIMIT,
        **keys,
    }


@pytest.mark.slow
def test_train_with_eval_tasks_scores_base_and_tuned_after_training(assets, ferry_run, llamafactory_data, tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "train.yaml", _train_config(assets, llamafactory_data, out))
    proc = run_ferry_train(config, "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path, offline=True)
    summary = proc.stdout[proc.stdout.index("lm-eval, base vs tuned (") :].splitlines()
    assert summary[0] == f"lm-eval, base vs tuned ({out / 'eval' / 'report.md'}):"
    assert summary[1].split() == ["task", "metric", "base", "tuned", "diff", "stderr"]
    report = json.loads((out / "eval" / "report.json").read_text())
    assert json.loads((out / "train_report.json").read_text())["eval"] == report
    assert {(r["task"], r["metric"]) for r in report["rows"]} >= {("ferry_mc", "acc"), ("ferry_ppl", "bits_per_byte")}
    # the same base model, tasks and limit as `ferry eval` above: the same base scores (one thread here: fp32 sums
    # in another order)
    base = {(r["task"], r["metric"]): r["base"] for r in ferry_run["report"]["rows"]}
    assert [r["base"] for r in report["rows"]] == pytest.approx(
        [base[(r["task"], r["metric"])] for r in report["rows"]], rel=1e-6
    )
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["base", "logs", "report.json", "report.md", "tuned"]
    base_results = json.loads((out / "eval" / "base" / "results.json").read_text())
    assert report["versions"] == {t: str(v) for t, v in base_results["versions"].items()}
    # the export's model card and lineage carry the scores and the task versions
    from exporter.export import export

    export(out / "adapter", tmp_path / "merged")
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "## Evaluation" in card and "| task | version | metric | base | tuned | diff | stderr |" in card
    acc = next(r for r in report["rows"] if (r["task"], r["metric"]) == ("ferry_mc", "acc"))
    version = report["versions"]["ferry_mc"]
    assert f"| ferry_mc | {version} | acc | {acc['base']:.4f} | {acc['tuned']:.4f} | {acc['difference']:+.4f} |" in card
    lineage = json.loads((tmp_path / "merged" / "ferry_export.json").read_text())
    assert lineage["eval"]["versions"] == report["versions"]
    assert [(r["task"], r["metric"], r["tuned"]) for r in lineage["eval"]["rows"]] == [
        (r["task"], r["metric"], r["tuned"]) for r in report["rows"]
    ]


def test_eval_tasks_that_are_not_installed_fail_before_training(assets, llamafactory_data, tmp_path):
    out = tmp_path / "out"
    keys = {"eval_tasks": "arc_challenge", "eval_include_path": None}
    config = write_config(tmp_path / "train.yaml", _train_config(assets, llamafactory_data, out, **keys))
    proc = run_ferry_train(config, "--dry-run", env=worker_env(tmp_path), cwd=tmp_path, offline=True, check=False)
    assert proc.returncode == 4, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("ferry: error:")]
    assert "task 'arc_challenge' reads allenai/ai2_arc (ARC-Challenge), which is not installed" in line
    assert not (out / "adapter").exists()


def test_a_task_folder_is_copied_with_yaml_relative_data_files_made_absolute(tmp_path, monkeypatch):
    """Only entries that exist beside the YAML and not under the working directory change; tags, absolute paths
    and URLs stay; a folder with nothing to change is used as it is."""
    from evaluation.task_folder import localized

    folder = tmp_path / "tasks"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "a.jsonl").write_text("{}\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "b.jsonl").write_text("{}\n")
    (folder / "t.yaml").write_text(
        "task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data/a.jsonl\n"
        "    train: [sub/b.jsonl, /abs/c.jsonl, https://example.org/d.jsonl]\n"
        "process_docs: !function utils.process_docs\n"
    )
    (folder / "plain.yaml").write_text("task: p\ndataset_path: acme/qa\n")
    monkeypatch.chdir(tmp_path)
    copy = localized(folder, tmp_path / "scratch")
    assert copy == tmp_path / "scratch" / "tasks" and (folder / "t.yaml").read_text().count("data/a.jsonl") == 1
    text = (copy / "t.yaml").read_text()
    assert f"test: {folder / 'data' / 'a.jsonl'}" in text and str(folder / "sub" / "b.jsonl") in text
    assert "/abs/c.jsonl" in text and "https://example.org/d.jsonl" in text
    assert "!function 'utils.process_docs'" in text
    assert (copy / "plain.yaml").read_text() == "task: p\ndataset_path: acme/qa\n"
    monkeypatch.chdir(folder)  # from the folder itself the relative paths already resolve: nothing to change
    assert localized(folder, tmp_path / "scratch2") == folder


def test_lm_evals_cached_results_are_keyed_by_content_not_by_temp_paths(tmp_path, monkeypatch):
    """The goldens' cache (tests/support/evalrun.py): the same arguments on the same bytes in another temp folder
    read the stored results without running lm-eval; a changed data row runs it again."""
    import tests.support.evalrun as evalrun

    monkeypatch.setattr(evalrun, "LM_EVAL_GOLDENS", tmp_path / "goldens")
    runs: list[list[str]] = []

    def fake_lm_eval(argv, **kwargs):
        runs.append(argv)
        out = Path(argv[argv.index("--output_path") + 1]) / "model"
        out.mkdir(parents=True)
        (out / "results_1.json").write_text(json.dumps({"results": {"run": len(runs)}}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(evalrun.subprocess, "run", fake_lm_eval)

    def golden(root: Path, row: str) -> dict:
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "data" / "mc.jsonl").write_text(row)
        (root / "tasks").mkdir(exist_ok=True)
        (root / "tasks" / "t.yaml").write_text(f"dataset_kwargs:\n  data_files: {root / 'data' / 'mc.jsonl'}\n")
        args = ["--model_args", f"pretrained={root / 'data'}", "--include_path", str(root / "tasks")]
        inputs = {"model": root / "data", "tasks": root / "tasks", "data": root / "data"}
        return evalrun.lm_eval_cli_cached(args, root / "out", {}, inputs)

    assert golden(tmp_path / "a", '{"q": 1}\n') == {"results": {"run": 1}}
    assert golden(tmp_path / "b", '{"q": 1}\n') == {"results": {"run": 1}}  # another folder, the same bytes
    assert len(runs) == 1
    assert golden(tmp_path / "c", '{"q": 2}\n') == {"results": {"run": 2}}  # a changed row runs lm-eval again
    assert len(runs) == 2 and runs[1][1:3] == ["-m", "lm_eval"]
    # online goldens: what the test hub serves is in the key, its git commits are not
    repo = tmp_path / "hub" / "datasets" / "org" / "data"
    (repo / ".git").mkdir(parents=True)
    (repo / "test.parquet").write_bytes(b"rows")
    (repo / ".git" / "HEAD").write_text("commit made at 10:00")
    served = evalrun.content_digest(tmp_path / "hub", {})
    (repo / ".git" / "HEAD").write_text("the same files committed at 10:05")
    assert evalrun.content_digest(tmp_path / "hub", {}) == served
    (repo / "test.parquet").write_bytes(b"other rows")
    assert evalrun.content_digest(tmp_path / "hub", {}) != served
    args, inputs = ["--model_args", "pretrained=<m>"], {}
    for i, (hub, run) in enumerate(((served, 3), (served, 3), (evalrun.content_digest(tmp_path / "hub", {}), 4))):
        got = evalrun.lm_eval_cli_cached(args, tmp_path / f"o{i}", {}, inputs, extra_key={"hub": hub})
        assert got == {"results": {"run": run}}
