"""What ``ferry eval`` is asked to do: :class:`EvalConfig`, read from a YAML file and flags.

The keys follow LLaMA-Factory's naming where it has one (``model_name_or_path``, ``adapter_name_or_path``,
``output_dir``) and lm-evaluation-harness's where it does not (``tasks``, ``num_fewshot``, ``limit``,
``batch_size``, ``include_path``, ``bootstrap_iters``). Every field is also a ``ferry eval`` flag of the same
name (``_`` spelled ``-``, :mod:`ferry.cli.flags`); a flag given wins over the file's key.

Values are normalised here, so the run never parses text again: ``tasks: a,b`` becomes ``["a", "b"]``;
``max_drop: 0.02`` stays a float for every task and ``max_drop: "arc_easy=0.02,hellaswag=0.05"`` (the flag's
spelling) becomes a mapping. Any mistake is one :class:`ferry.errors.ConfigError` line naming the key.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ferry.errors import ConfigError
from ferry.flags import Flag
from ferry.yaml_config import read_yaml_mapping

_log = logging.getLogger("ferry.evaluation")


def _names(value: Any) -> Any:
    """``"a, b"`` -> ``["a", "b"]``; a list keeps its items, stripped; anything else is left to pydantic."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, (list, tuple)):
        return [str(item).strip() for item in value if str(item).strip()]
    return value


def parse_max_drop(value: Any) -> Any:
    """``"0.02"`` -> ``0.02``; ``"arc_easy=0.02,piqa=0.05"`` -> ``{"arc_easy": 0.02, "piqa": 0.05}``; a number or a
    mapping is left to pydantic.

    Raises:
        ValueError: a ``TASK=DROP`` item without its ``=``.
    """
    if not isinstance(value, str):
        return value
    if "=" not in value:
        return value.strip()
    drops: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        task, sep, drop = item.partition("=")
        if not sep or not task.strip():
            raise ValueError(f"expected TASK=DROP items separated by commas, got {item.strip()!r}")
        drops[task.strip()] = drop.strip()
    return drops


class EvalConfig(BaseModel):
    """One ``ferry eval`` run: which model (and adapter), which lm-eval tasks, how, and where to write."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_name_or_path: Annotated[str, Flag(metavar="MODEL")] = Field(
        description="Base model: a folder, or a repo id installed in the offline hub cache (ferry install)."
    )
    adapter_name_or_path: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="PEFT LoRA adapter folder; the base and base + adapter are both evaluated."
    )
    tasks: Annotated[list[str], Flag(metavar="A,B")] = Field(
        description="lm-eval task names, comma-separated (built-in ones, or those under include_path)."
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt [default: each task's].")
    limit: float | None = Field(
        None, gt=0, description="Documents per task: a whole number, or a fraction < 1 of each task's set."
    )
    batch_size: int | Literal["auto"] = Field(1, description="Batch size, or auto (lm-eval finds the largest).")
    output_dir: Annotated[str, Flag(metavar="DIR")] = Field(
        description="Folder for lm-eval's results JSON of each model and ferry's report.json / report.md."
    )
    include_path: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="Folder of custom lm-eval task YAMLs (lm-eval's --include_path)."
    )
    max_drop: Annotated[float | dict[str, float] | None, Flag(metavar="DROP|TASK=DROP,...")] = Field(
        None,
        description="Gate: fail when a tuned metric is worse than the base's by more than this (one value for "
        "every task, or TASK=DROP items).",
    )
    gen_kwargs: Annotated[str | None, Flag(metavar="K=V,...")] = Field(
        None,
        description="Generation settings over every generative task's own, as lm-eval's --gen_kwargs "
        "(max_gen_toks=256,temperature=0).",
    )
    device: str | None = Field(None, description="cpu, cuda, cuda:1 [default: cuda when torch sees a GPU, else cpu].")
    bootstrap_iters: int = Field(
        100000, ge=0, description="Bootstrap resamples for stderrs of non-mean metrics (lm-eval's default)."
    )
    trust_remote_code: bool = Field(False, description="Allow the model's own Python code to run.")
    apply_chat_template: bool = Field(
        False,
        description="Render every prompt with a chat template: the adapter's trained one (its chat_template.jinja) "
        "for the base and the tuned model alike, else the model's own.",
    )
    system_instruction: str | None = Field(None, description="With apply_chat_template: a system message.")
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Ranks on this node (torchrun; one GPU each on CUDA, gloo on CPU): each evaluates a share of "
        "every task's requests.",
    )

    _tasks = field_validator("tasks", mode="before")(_names)
    _max_drop = field_validator("max_drop", mode="before")(parse_max_drop)

    @field_validator("tasks")
    @classmethod
    def _some_tasks(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one task")
        return list(dict.fromkeys(value))

    @field_validator("gen_kwargs")
    @classmethod
    def _key_values(cls, value: str | None) -> str | None:
        for item in (value or "").split(","):
            if value and (not item.partition("=")[0].strip() or "=" not in item):
                raise ValueError(f"expected KEY=VALUE items separated by commas, got {item.strip()!r}")
        return value

    @field_validator("limit")
    @classmethod
    def _fraction_or_count(cls, value: float | None) -> float | None:
        if value is not None and value > 1 and value != int(value):
            raise ValueError("a whole number of documents, or a fraction < 1")
        return value

    def lm_eval_limit(self) -> int | float | None:
        """``limit`` as lm-eval reads it: an int counts documents, a float < 1 is a fraction."""
        if self.limit is None or self.limit < 1:
            return self.limit
        return int(self.limit)

    def drop_for(self, task: str) -> float | None:
        """The largest drop allowed on ``task``, or None when the gate does not look at it."""
        if isinstance(self.max_drop, dict):
            return self.max_drop.get(task)
        return self.max_drop


def load_eval_config(path: str | os.PathLike[str] | None, given: Mapping[str, Any] | None = None) -> EvalConfig:
    """The :class:`EvalConfig` of the YAML file ``path`` (None: ``given`` alone), ``given``'s values on top.

    Raises:
        ConfigError: the file is unreadable or not a mapping; an unknown key (with the nearest known one); a
            missing or invalid value (naming the key and where it came from).
    """
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        for key, value in read_yaml_mapping(path).items():
            data[str(key)], origin[str(key)] = value, str(path)
    for key, value in (given or {}).items():
        data[key], origin[key] = value, f"--{key.replace('_', '-')}"
    translate_lf_eval_keys(data, origin)
    _drop_lf_eval_keys(data, str(path) if path is not None else "ferry eval")
    fields = list(EvalConfig.model_fields)
    for key in data:
        if key not in EvalConfig.model_fields:
            near = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{origin[key]}: unknown key {key!r}{hint}")
    try:
        return EvalConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, data, origin, path)) from None


#: LLaMA-Factory's ``task: NAME_SPLIT`` (its evaluation harness, removed in 0.9.5) -> the lm-eval task that scores
#: the same benchmark on the same split.
LF_EVAL_TASKS = {"mmlu_test": "mmlu", "cmmlu_test": "cmmlu", "ceval_validation": "ceval-valid"}
#: LLaMA-Factory eval keys that have no effect here: what each one did there.
_LF_DROPPED = {
    "lang": "the task fixes its language",
    "task_dir": "lm-eval's task YAMLs are used",
    "template": "lm-eval's own prompt of each task is used",
    "seed": "lm-eval's fixed seeds are used",
    "download_mode": "nothing is downloaded",
}


def translate_lf_eval_keys(data: dict[str, Any], origin: dict[str, str]) -> list[str]:
    """Rewrite LLaMA-Factory's evaluation keys (``task: mmlu_test``, ``n_shot``, ``save_dir``, ``lang``,
    ``task_dir``, ``template``, ``seed``, ``finetuning_type: lora``) into ferry's, in place, and log one line saying
    what became what. lm-eval's prompts are not LLaMA-Factory's, so the scores differ from LLaMA-Factory's own.

    Returns the notes logged (empty when no such key is present).

    Raises:
        ConfigError: a ``task`` with no lm-eval equivalent (the three there are, named); ``task`` together with
            ``tasks``; ``finetuning_type`` other than lora (a merged model is a plain ``model_name_or_path``).
    """
    notes: list[str] = []
    if "task" in data:
        value = str(data.pop("task"))
        if "tasks" in data:
            raise ConfigError(f"{origin['task']}: task (LLaMA-Factory's) and tasks are both set; keep tasks")
        if value not in LF_EVAL_TASKS:
            known = ", ".join(f"{k} ({v})" for k, v in LF_EVAL_TASKS.items())
            raise ConfigError(f"{origin['task']}: task {value!r} has no lm-eval equivalent here; known: {known}")
        data["tasks"], origin["tasks"] = LF_EVAL_TASKS[value], origin["task"]
        notes.append(f"task: {value} -> tasks: {LF_EVAL_TASKS[value]}")
    for old, new in (("n_shot", "num_fewshot"), ("save_dir", "output_dir")):
        if old in data:
            value = data.pop(old)
            if new not in data:
                data[new], origin[new] = value, origin[old]
                notes.append(f"{old}: {value} -> {new}")
    if "finetuning_type" in data:
        value = data.pop("finetuning_type")
        if value != "lora":
            raise ConfigError(
                f"{origin['finetuning_type']}: finetuning_type: {value}: ferry eval evaluates a base and a LoRA "
                f"adapter; give a {value}-tuned or merged model as model_name_or_path"
            )
    dropped = [f"{key} ({why})" for key, why in _LF_DROPPED.items() if data.pop(key, None) is not None]
    if dropped:
        notes.append("ignored: " + ", ".join(dropped))
    if notes:
        _log.warning(
            "LLaMA-Factory eval keys: %s; lm-eval's prompts differ from LLaMA-Factory's, so do the scores",
            "; ".join(notes),
        )
    return notes


def _drop_lf_eval_keys(data: dict[str, Any], where: str) -> None:
    """Drop, without a word, every other key LLaMA-Factory 0.9.5's eval parser takes (its model, data, evaluation
    and fine-tuning arguments: ``dataset_dir``, ``cutoff_len``, ``infer_dtype``, ...; :func:`ferry.lf_keys.lf_keys`),
    as a YAML that runs there has nothing in them for lm-eval; the keys that would make LLaMA-Factory evaluate
    another model (``model_revision``, ``rope_scaling``, ``quantization_bit`` at another value than its default)
    are refused.

    Raises:
        ConfigError: ``WHERE: KEY: why`` for such a key (:func:`ferry.lf_keys.refuse_model_changes`).
    """
    from ferry.lf_keys import lf_keys, refuse_model_changes

    refuse_model_changes(data, where)
    taken = lf_keys("eval")
    for key in [k for k in data if k not in EvalConfig.model_fields and k in taken]:
        del data[key]


def _describe(exc: ValidationError, data: Mapping[str, Any], origin: Mapping[str, str], path: Any) -> str:
    """pydantic's first error as one line: where, which key, what is wrong, the value given."""
    err = exc.errors()[0]
    key = str(err["loc"][0]) if err.get("loc") else ""
    if err["type"] == "missing":
        where = f"{path}: " if path is not None else ""
        return f"{where}missing required key {key!r} (or --{key.replace('_', '-')})"
    text = str(err["msg"]).removeprefix("Value error, ")
    return f"{origin.get(key, 'config')}: key {key!r}: {text} (got {data.get(key)!r})"


__all__ = ["LF_EVAL_TASKS", "EvalConfig", "load_eval_config", "parse_max_drop", "translate_lf_eval_keys"]
