"""Video rows against LLaMA-Factory 0.9.5's own output (tests/golden/vlm_video.json, made by
tests/golden/make_video_goldens.py through its ``get_dataset`` and ``get_mm_inputs``) on its own mllm_video_demo
rows and MP4/AVI files (the hash-pinned sdist); trained, and LLaMA-Factory's qwen3vl_lora_sft.yaml with the video
dataset its comment names run end to end.

transformers' video processors need torchvision, which cannot load beside the suite's CPU torch 2.13, so every
video path runs in a Python whose torch, torchvision and PyAV come from a kept environment (tests/support/video_env.py)
and the rest from the suite's own site-packages: ``tests/support/video_probe.py`` reports what ferry made and these
tests judge it. In the suite's own Python (no torchvision) a dataset with a videos column is refused in one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from ferry.errors import ConfigError
from tests.support.helpers import adapter_tensors, train_losses, worker_env, write_config
from tests.support.netns import run_offline
from trainer.launch import LaunchReport

pytestmark = pytest.mark.budget(150, reason="the video probe and a 2-rank torchrun in the torchvision environment")

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "vlm_video.json").read_text(encoding="utf-8"))
#: tests/support/vlm.py's added tokens' ids
VISION_END, IMAGE_ID, VIDEO_ID = 515, 516, 517


def _row(user: str, *videos: str) -> dict:
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": "She is cooking."}]
    return {"messages": turns, "videos": list(videos)}


GOOD = "mllm_demo_data/1.mp4"
#: the golden cases whose prompts are served through the written chat template
SERVED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
#: a ranking entry with a videos column (LLaMA-Factory's sharegpt ranking layout)
RANKING = {
    "ranking": True,
    "formatting": "sharegpt",
    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "videos": "videos"},
}
#: bad rows: name -> (rows, keys over qwen2_vl's); what each must raise is in the test below
REFUSALS = {
    "missing": ([_row("<video>Hi", GOOD), _row("<video>Hi", "mllm_demo_data/9.mp4")], {}),
    "not-a-video": ([_row("<video>Hi", "mllm_demo_data/broken.mp4")], {}),
    "audio-only": ([_row("<video>Hi", "mllm_demo_data/2.wav")], {}),  # LLaMA-Factory's own audio demo file
    "more-placeholders": ([_row("<video><video>Hi", GOOD)], {}),
    "fewer-placeholders": ([_row("Hi", GOOD)], {}),
    "frames-as-images": ([_row("<video>Hi", ["mllm_demo_data/1.jpg", "mllm_demo_data/2.jpg"])], {}),
    "dpo": (
        [
            {
                "conversations": [{"from": "human", "value": "<video>What is she doing?"}],
                "chosen": {"from": "gpt", "value": "She is cooking."},
                "rejected": {"from": "gpt", "value": "She is asleep."},
                "videos": [GOOD],
            }
        ],
        {"stage": "dpo"},
    ),
    "cut": ([_row("<video>Hi", GOOD), _row("Hi <video>", "mllm_demo_data/3.mp4")], {"cutoff_len": 700}),
    "timed-template": ([_row("<video>Hi", GOOD)], {"template": "qwen3_vl"}),  # on a Qwen2-VL processor
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory, sdist_data: Path, stories_model: Path) -> dict:
    """One run of tests/support/video_probe.py in the torchvision Python: the golden cases, the bad rows, the
    served prompts, one training step per family."""
    from tests.support.video_env import video_python

    work = tmp_path_factory.mktemp("video-probe")
    python = video_python(work / "python")
    request = {
        "data": str(sdist_data),
        "stories": str(stories_model),
        "work": str(work),
        "cases": {name: {"family": c["family"], "keys": c["keys"]} for name, c in GOLDEN["cases"].items()},
        "refusals": {
            name: {
                "family": "qwen2_vl",
                "rows": rows,
                "keys": {"template": "qwen2_vl", **keys},
                "entry": RANKING if name == "dpo" else None,
            }
            for name, (rows, keys) in REFUSALS.items()
        },
        "served": {
            name: {"family": c["family"], "keys": c["keys"]} for name, c in GOLDEN["cases"].items() if name in SERVED
        },
        "losses": ["qwen2_5_vl", "qwen3_vl"],
    }
    (work / "request.json").write_text(json.dumps(request))
    env = worker_env(work, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    argv = [str(python), str(ROOT / "tests" / "support" / "video_probe.py"), str(work / "request.json")]
    proc = run_offline([*argv, str(work / "result.json")], env=env, cwd=work, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads((work / "result.json").read_text()), "python": python, "work": work}


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_video_rows_equal_llamafactory(case: str, probe: dict) -> None:
    """input_ids and labels token for token (each ``<video>`` expanded into its slot: one for Qwen2-VL's template,
    one per temporal patch behind its time for Qwen3-VL's), the batch's video pixels, grids and Qwen2.5-VL's
    seconds per grid, for every mllm_video_demo row (and mllm_demo's images beside them in ``+mixed``), under
    LLaMA-Factory's templates and its video keys."""
    golden, ours = GOLDEN["cases"][case], probe["cases"][case]
    assert len(ours["rows"]) == len(golden["rows"]) >= 3
    assert ours["stats"]["num_videos"] == sum(len(r["videos"]) for r in golden["rows"]) == 3
    for mine, theirs in zip(ours["rows"], golden["rows"]):
        assert mine["input_ids"] == theirs["input_ids"]
        assert mine["labels"] == theirs["labels"]
        assert (mine["images"], mine["videos"]) == (theirs["images"], theirs["videos"])
        for key in ("image_grid_thw", "video_grid_thw"):
            assert mine.get(key) == theirs.get(key), key
        assert mine.get("second_per_grid_ts") == (
            pytest.approx(theirs["second_per_grid_ts"], rel=1e-6) if "second_per_grid_ts" in theirs else None
        )
        for key in ("pixel_values", "pixel_values_videos"):
            if key in theirs:
                assert mine[key]["shape"] == theirs[key]["shape"], key
                assert mine[key]["sum"] == pytest.approx(theirs[key]["sum"], rel=1e-5), key
                assert mine[key]["weighted"] == pytest.approx(theirs[key]["weighted"], rel=1e-5), key
            else:
                assert key not in mine, key
        kinds = {IMAGE_ID: 1, VIDEO_ID: 2}
        assert mine["mm_token_type_ids"] == [kinds.get(t, 0) for t in mine["input_ids"]]
        # a slot per video (qwen2_vl's plugin) or per temporal patch (qwen3_vl's, each behind its time)
        slots = [
            t if golden["keys"]["template"].startswith("qwen3") else 1 for t, _, _ in theirs.get("video_grid_thw", [])
        ]
        assert mine["input_ids"].count(VISION_END) == len(theirs["images"]) + sum(slots)


def test_bad_video_rows_are_refused_naming_the_row(probe: dict) -> None:
    """A missing video, a file that is no video, an audio file (no video stream), more or fewer placeholders than
    videos, a video given as frame images, a video row in a preference stage, a template with per-frame times on a
    processor without them: each one line naming the row (or the dataset); a sample whose cutoff would cut through
    a video is dropped and counted, never trained on."""
    got = probe["refusals"]
    expected = {
        "missing": ("DataError", r"rows\.json: row 2: video .*9\.mp4 does not exist"),
        "not-a-video": ("DataError", r"row 1: video .*broken\.mp4 is no video with a duration and a frame rate"),
        "audio-only": ("DataError", r"row 1: video .*2\.wav holds no video stream$"),
        "more-placeholders": ("DataError", r"row 1: 2 <video> placeholder\(s\) in the messages but 1 video\(s\)"),
        "fewer-placeholders": ("DataError", r"row 1: 0 <video> placeholder\(s\) in the messages but 1 video\(s\)"),
        "frames-as-images": ("DataError", r"row 1: videos entry is list, not a file path"),
        "dpo": ("ConfigError", r"dataset 'rows' has a videos column: video rows train with stage sft"),
        "timed-template": ("ConfigError", r"puts a time before each video frame .* Qwen2VLProcessor computes none"),
    }

    for name, (error, pattern) in expected.items():
        assert got[name].get("error") == error, (name, got[name])
        assert re.search(pattern, got[name]["message"]) and "\n" not in got[name]["message"], (name, got[name])
    cut = got["cut"]["stats"]  # 1.mp4's slot ends past 700 tokens; 3.mp4's row fits
    assert cut["num_dropped_image_cut"] == 1 and cut["num_train_samples"] == 1 and cut["num_videos"] == 1
    config = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "dataset": ["rows"]}
    report = LaunchReport(
        config=config, world_size=1, nproc_per_node=1, nnodes=1, global_batch_size=1, steps_per_epoch=1,
        total_steps=1, num_train_samples=1, num_eval_samples=0, num_dropped_samples=0, tokens_per_step=1.0,
        trainable_params=0, total_params=0, command=[], dry_run=True, data_stats=cut,
    )  # fmt: skip
    lines = report.summary().splitlines()  # the run summary counts both
    assert "videos:              1" in lines
    assert "images:              0 (samples dropped, cutoff_len would cut an image: 1)" in lines


@pytest.mark.parametrize("case", SERVED)
def test_the_written_chat_template_serves_a_video_part_as_training_rendered_it(case: str, probe: dict) -> None:
    """A client's prompt with a ``video`` content part, rendered by the chat template ferry writes into the adapter
    and the export and expanded by transformers' own processor (the frames ferry samples), is token for token the
    prompt of the training row."""
    pairs = probe["served"][case]
    assert len(pairs) == 3
    for pair in pairs:
        assert pair["served"] == pair["trained"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_first_loss_is_transformers_own_on_the_video_batch(family: str, probe: dict) -> None:
    """One step over the three video rows: ferry's logged loss equals the loss transformers' model class computes
    from the same batch with ``labels`` (Qwen2.5-VL's ``second_per_grid_ts`` among its inputs), to 1e-6; the same
    batch with other video pixels (mirrored, negated, zeroed) moves the loss by more than ten times that."""
    ours = probe["losses"][family]
    assert ours["num_train_samples"] == 3 and ours["num_videos"] == 3
    assert ours["logged"] == [pytest.approx(ours["transformers"], rel=1e-6)]
    assert ("second_per_grid_ts" in ours["inputs"]) == (family == "qwen2_5_vl")
    assert max(abs(other - ours["transformers"]) for other in ours["others"]) > 10 * 1e-6 * ours["transformers"]


@pytest.mark.two_ranks
def test_llamafactorys_qwen3vl_example_on_its_video_dataset_trains_offline_on_two_ranks_and_exports(
    probe: dict, sdist_data: Path, tmp_path: Path
) -> None:
    """train_lora/qwen3vl_lora_sft.yaml with ``dataset: mllm_video_demo`` (the alternative its own comment names),
    paths and sizes changed only: ``ferry train`` on 2 gloo ranks with no network at all trains the three video
    rows (its ``video_max_pixels: 16384`` in force), the adapter only on the language model; ``ferry export`` merges
    it and the smoke check passes, a video prompt among its prompts."""
    from tests.support.pinned_sdist import LLAMAFACTORY

    python = probe["python"]
    model = probe["work"] / "models" / "qwen3_vl"  # the probe's tiny Qwen3-VL with its whole processor
    text = (LLAMAFACTORY.path() / "examples" / "train_lora" / "qwen3vl_lora_sft.yaml").read_text()
    keys = yaml.safe_load(text)
    assert keys["video_max_pixels"] == 16384 and "# video: mllm_video_demo" in text
    keys.update(
        model_name_or_path=str(model),
        dataset="mllm_video_demo",
        dataset_dir=str(sdist_data),
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        gradient_accumulation_steps=1,
        cutoff_len=1024,
        dataloader_num_workers=0,
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
    )
    config = write_config(tmp_path / "video.yaml", keys)
    env = worker_env(tmp_path, HF_HUB_OFFLINE="1")
    train = [str(python), "-m", "ferry", "train", str(config), "--nproc-per-node", "2"]
    proc = run_offline(train, env=env, cwd=tmp_path, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["num_train_samples"] == 3
    assert len(train_losses(tmp_path / "out")) == 2
    adapter = adapter_tensors(tmp_path / "out" / "adapter")
    assert adapter and all(".language_model." in key and "visual" not in key for key in adapter)
    merged = tmp_path / "merged"
    export = [str(python), "-m", "ferry", "export", "--adapter", str(tmp_path / "out" / "adapter"), "-o", str(merged)]
    proc = run_offline(export, env=env, cwd=tmp_path, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    smoke = json.loads((merged / "smoke_report.json").read_text())
    assert smoke["passed"], smoke
    # the smoke check's image and video prompts (fixed frames, laid out with their times) through the merged model
    # and through base + adapter (peft) give the same logits
    media = {p["prompt"]: p for p in smoke["prompts"] if p["prompt"].startswith(("<image>", "<video>"))}
    assert set(media) == {"<image>Describe this image.", "<video>Describe this video."}, list(media)
    assert all(p["max_abs_diff"] <= 1e-4 for p in media.values()), media
    # transformers 5 writes the image and video processors into processor_config.json: carried as it is
    processor = (model / "processor_config.json").read_bytes()
    assert (merged / "processor_config.json").read_bytes() == processor
    assert "video_processor" in json.loads(processor)


def test_without_torchvision_a_videos_column_is_refused_in_one_line(
    sdist_data: Path, stories_model: Path, tmp_path: Path
) -> None:
    """In the suite's own Python (CPU torch, no torchvision): mllm_video_demo is refused before anything is
    tokenised, in one line naming the dataset and what is missing."""
    from tests.support.vlm import write_processor_files
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer, prepare_data

    model = write_processor_files(tmp_path / "model", "qwen2_vl", stories_model)
    cfg = TrainConfig(
        model_name_or_path=str(model),
        dataset=["mllm_video_demo"],
        dataset_dir=str(sdist_data),
        template="qwen2_vl",
        output_dir=str(tmp_path / "out"),
        tokenized_path=str(tmp_path / "tok"),
    )
    with pytest.raises(ConfigError) as err:
        prepare_data(cfg, load_tokenizer(cfg))
    message = str(err.value)
    assert message.startswith("dataset 'mllm_video_demo' has a videos column: video rows need torchvision"), message
    assert "\n" not in message and not (tmp_path / "tok").exists()
    shutil.rmtree(model)
