"""``ferry demo``: the whole journey on the embedded default, offline, in a few minutes on a laptop CPU.

Stages, each timed (the online host and the isolated host are the same machine here, and nothing touches the
network: the sources are local and the bundle carries no wheels, because this process's own environment
already has ferry installed)::

    build    the seeded tiny Llama (ferry.cli.demo_assets) and the ferry_demo dataset, into WORKDIR/src
    pack     bundler.pack            -> WORKDIR/out/ferry-demo/ and WORKDIR/out/ferry-demo.ferry.tar
    verify   bundler.verify          the archive, every member against the manifest
    install  bundler.install         the archive into WORKDIR/prefix (HF cache layout, datasets, ferry.env)
    train    trainer.launch          LoRA, DDP under torchrun, 2 processes on CPU (gloo), by repo id
    export   exporter.export         streaming merge into safetensors + the smoke check

It returns a :class:`DemoReport` whose ``table()`` the CLI prints.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError
from ferry.fsutil import atomic_write_text, format_bytes

BUNDLE_NAME = "ferry-demo"
MODEL_FOLDER = "tiny-llama"
#: ``ferry install`` places a local folder ``NAME`` as repo id ``local/NAME``.
MODEL_REPO_ID = f"local/{MODEL_FOLDER}"

#: The demo's training config: LLaMA-Factory keys; 360 steps, about 30 s of training loop on 2 idle CPU cores.
#: Measured on the seeded base: loss 6.67 -> 4.18, and the merged model answers "Say hello." with text from the
#: dataset. Gradient checkpointing (LLaMA-Factory's default) is off: a 1M-parameter model has no activation memory
#: worth saving, and recomputing each layer's forward made the loop 1.5x longer (46 s against 30 s).
DEMO_TRAIN_CONFIG: dict[str, Any] = {
    "model_name_or_path": MODEL_REPO_ID,
    "dataset": "ferry_demo",
    "template": "alpaca",
    "cutoff_len": 128,
    "lora_rank": 32,
    "lora_alpha": 64,
    "lora_target": "all",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "learning_rate": 2.0e-3,
    "num_train_epochs": 60,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.05,
    "logging_steps": 20,
    "save_steps": 180,
    "save_total_limit": 1,
    "seed": 42,
    "disable_gradient_checkpointing": True,
}

#: Questions from the demo dataset; the smoke check renders them with the exported chat template (alpaca).
DEMO_QUESTIONS = ("Say hello.", "What does ferry pack do?", "What is LoRA?")


@dataclass
class Stage:
    """One stage of the demo: its name, wall time (seconds) and a one-line outcome."""

    name: str
    seconds: float
    detail: str


@dataclass
class DemoReport:
    """What ``ferry demo`` did: the stages in order and where the outputs are."""

    workdir: Path
    stages: list[Stage] = field(default_factory=list)
    outputs: dict[str, Path] = field(default_factory=dict)
    train_loss_first: float | None = None
    train_loss_final: float | None = None
    smoke_passed: bool | None = None
    adapter_changed_output: bool | None = None
    answers: list[tuple[str, str]] = field(default_factory=list)

    def table(self) -> str:
        """The closing summary: one row per stage (time, outcome), then the outputs and the merged answers."""
        width = max(len(s.name) for s in self.stages) if self.stages else 5
        lines = [f"{'stage'.ljust(width)}  {'time':>7}  result", f"{'-' * width}  {'-' * 7}  {'-' * 50}"]
        for s in self.stages:
            lines.append(f"{s.name.ljust(width)}  {s.seconds:6.1f}s  {s.detail}")
        total = sum(s.seconds for s in self.stages)
        lines.append(f"{'total'.ljust(width)}  {total:6.1f}s")
        lines.append("")
        for name, path in self.outputs.items():
            lines.append(f"{name:<9} {path}")
        if self.answers:
            lines.append("")
            lines.append("merged model, greedy:")
            for question, answer in self.answers:
                lines.append(f"  {question!r} -> {answer!r}")
        return "\n".join(lines)


def run_demo(
    workdir: str | os.PathLike | None = None,
    *,
    nproc_per_node: int = 2,
    log: Callable[[str], None] = print,
) -> DemoReport:
    """Run every stage of the demo in ``workdir`` (default: a new temporary directory, kept for inspection).

    Args:
        workdir: an empty or absent directory for the sources, bundle, prefix, run and export.
        nproc_per_node: training processes (gloo on CPU, nccl when CUDA is available).
        log: where stage headers go.

    Returns:
        The :class:`DemoReport`.

    Raises:
        ConfigError: ``workdir`` exists and is not empty (nothing in it is touched).
        FerryError: any stage's own errors (IntegrityError, TrainingError, SmokeCheckError, ...).
    """
    _import_stage_libraries()
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="ferry-demo-"))
    workdir = Path(workdir).absolute()
    if workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"demo workdir {workdir} is not empty: give a new or empty --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    report = DemoReport(workdir=workdir)
    from ferry.output import route_library_output  # the libraries' bars and warnings to a log file

    library_log = workdir / "logs" / "libraries-demo.log"
    route_library_output(library_log)
    demo = _DemoStages(report, library_log, nproc_per_node)
    for name, stage in (
        ("build", demo.build),
        ("pack", demo.pack),
        ("verify", demo.verify),
        ("install", demo.install),
        ("train", demo.train),
        ("export+smoke", demo.export),
    ):
        log(f"== {name}")
        started = time.perf_counter()
        detail = stage()
        report.stages.append(Stage(name, time.perf_counter() - started, detail))
    return report


def _import_stage_libraries() -> None:
    """Import what the stages use (yaml, bundler, trainer, exporter, the demo's assets) before the workdir is made:
    a missing one fails before anything is written, and what they print while imported comes before the
    libraries' output goes to the log file."""
    import importlib

    for module in ("yaml", "bundler", "trainer", "exporter.export", "exporter.options", "ferry.cli.demo_assets"):
        importlib.import_module(module)


class _DemoStages:
    """The stages of one :func:`run_demo` in ``report.workdir``: each method runs one stage and returns its one-line
    outcome, filling ``report`` (outputs, losses, the smoke check's answers) as it goes."""

    def __init__(self, report: DemoReport, library_log: Path, nproc_per_node: int) -> None:
        workdir = report.workdir
        self.report, self.library_log, self.nproc_per_node = report, library_log, nproc_per_node
        self.workdir = workdir
        self.src = workdir / "src"
        self.out = workdir / "out"
        self.prefix = workdir / "prefix"
        self.run_dir = workdir / "run"
        self.merged = workdir / "merged"
        self.archive = self.out / f"{BUNDLE_NAME}.ferry.tar"

    def build(self) -> str:
        """The seeded tiny Llama and the ferry_demo dataset, into ``WORKDIR/src``."""
        from ferry.cli.demo_assets import build_demo_model, write_demo_dataset

        model = build_demo_model(self.src / MODEL_FOLDER)
        data = write_demo_dataset(self.src / "data")
        size = sum(f.stat().st_size for f in model.iterdir())
        return f"tiny Llama {format_bytes(size)} (seed 0), dataset {data.name}"

    def pack(self) -> str:
        """Pack the model and the dataset, without wheels, into ``WORKDIR/out``."""
        import bundler

        spec = bundler.load_spec(
            name=BUNDLE_NAME,
            models=[str(self.src / MODEL_FOLDER)],
            datasets=[str(self.src / "data" / "ferry_demo.json")],
            no_wheels=True,
        )
        result = bundler.pack(spec, self.out, progress=False)
        self.report.outputs["bundle"] = self.archive
        return f"{len(result.manifest['items'])} items, {format_bytes(result.content_bytes)} -> {self.archive.name}"

    def verify(self) -> str:
        """Verify every member of the archive against the manifest."""
        import bundler

        result = bundler.verify(self.archive)
        return f"{result.files_checked} files, {format_bytes(result.bytes_checked)}: all sha256 match"

    def install(self) -> str:
        """Install the archive into ``WORKDIR/prefix`` and take its environment (what ``source ferry.env`` does)."""
        import bundler

        result = bundler.install(self.archive, self.prefix, create_venv=False)
        os.environ.update(bundler.prefix_env(self.prefix))  # what `source PREFIX/ferry.env` does
        self.report.outputs["prefix"] = self.prefix
        return f"{MODEL_REPO_ID} -> HF cache, ferry_demo -> datasets/ ({result.files_checked} files)"

    def train(self) -> str:
        """LoRA on the installed model and dataset, by repo id (:data:`DEMO_TRAIN_CONFIG`), into ``WORKDIR/run``."""
        import yaml

        import trainer

        report = self.report
        config = {**DEMO_TRAIN_CONFIG, "output_dir": str(self.run_dir)}
        config_path = self.workdir / "train.yaml"
        atomic_write_text(config_path, yaml.safe_dump(config, sort_keys=False))
        result = trainer.launch(config_path, nproc_per_node=self.nproc_per_node)
        summary = result.train_report or {}
        report.train_loss_first = summary.get("train_loss_first")
        report.train_loss_final = summary.get("train_loss_final")
        report.outputs["adapter"] = Path(summary.get("adapter_dir", self.run_dir / "adapter"))
        return (
            f"{summary.get('global_steps')} steps on {result.world_size} processes, loss "
            f"{report.train_loss_first:.4f} -> {report.train_loss_final:.4f}, "
            f"{summary.get('tokens_per_second', 0):.0f} tokens/s"
        )

    def export(self) -> str:
        """Merge the adapter into ``WORKDIR/merged`` and run the smoke check on :data:`DEMO_QUESTIONS`."""
        from exporter.export import export as export_model
        from exporter.options import ExportOptions
        from ferry.output import route_library_output

        report = self.report
        # The export carries the template training used (chat_template.jinja): the smoke check renders each
        # question through it, so the served prompt is the trained one.
        prompts = list(DEMO_QUESTIONS)
        route_library_output(self.library_log)  # back from the training run's output_dir/logs/
        result = export_model(report.outputs["adapter"], self.merged, ExportOptions(prompts=prompts, max_new_tokens=24))
        smoke = result.smoke or {}
        report.smoke_passed = smoke.get("passed")
        report.adapter_changed_output = smoke.get("adapter_changed_output")
        report.answers = [(q, p["text"]) for q, p in zip(DEMO_QUESTIONS, smoke.get("prompts", []))]
        report.outputs["merged"] = self.merged
        diff = smoke.get("max_abs_diff")
        return (
            f"{len(result.shards)} shard(s), {format_bytes(result.total_bytes)}; smoke "
            f"{'passed' if report.smoke_passed else 'FAILED'} (max |logit diff| {diff:.2g}, adapter "
            f"{'changed' if report.adapter_changed_output else 'did not change'} the answers)"
        )
