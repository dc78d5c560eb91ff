"""Image rows, tokenised and batched, against LLaMA-Factory 0.9.5's own output (tests/golden/vlm.json, made by
tests/golden/make_vlm_goldens.py through its ``get_dataset`` and ``get_mm_inputs``) on its own mllm_demo data and
JPEGs (the hash-pinned sdist), with the Qwen2-VL / Qwen3-VL processors of tests/support/vlm.py; and every bad
input refused in one line naming the row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError, DataError
from tests.support.vlm import preference_folder, write_processor_files
from trainer.batching import collate_with_token_count
from trainer.data import load_tokenizer, prepare_data
from trainer.launch import LaunchReport

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "vlm.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def processors(tmp_path_factory, stories_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm-processors")
    return {family: write_processor_files(root / family, family, stories_model) for family in ("qwen2_vl", "qwen3_vl")}


def _cfg(model: Path, data: Path, work: Path, **keys):
    from trainer.config import TrainConfig

    return TrainConfig(
        model_name_or_path=str(model),
        dataset_dir=str(data),
        output_dir=str(work / "out"),
        tokenized_path=str(work / "tok"),
        **keys,
    )


def _weighted(tensor: torch.Tensor) -> float:
    flat = tensor.double().flatten()
    return float((flat * (torch.arange(flat.numel(), dtype=torch.float64) % 1009)).sum())


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_image_rows_equal_llamafactory(case: str, sdist_data: Path, processors, tmp_path: Path) -> None:
    """input_ids and labels token for token (each ``<image>`` expanded into the image's tokens, masked), and the
    batch's pixel values and grids, for every mllm_demo row, under LLaMA-Factory's templates and pixel keys."""
    from trainer.recipe import FinetuneRecipe  # noqa: F401  (the collate the recipe builds is the one tested)
    from trainer.vision import ImageProcessing

    golden = GOLDEN["cases"][case]
    cfg = _cfg(processors[golden["family"]], sdist_data, tmp_path, **golden["keys"])
    data = prepare_data(cfg, load_tokenizer(cfg))
    rows = list(data.train)
    assert len(rows) == len(golden["rows"]) == 6
    assert data.stats["num_images"] == sum(len(r["images"]) for r in golden["rows"])
    processing = ImageProcessing(processors[golden["family"]], cfg.image_max_pixels, cfg.image_min_pixels)
    for ours, theirs in zip(rows, golden["rows"]):
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]
        assert [Path(p).relative_to(sdist_data).as_posix() for p in ours["images"]] == theirs["images"]
        batch = collate_with_token_count([ours], pad_token_id=0, causal=True, images=processing, image_token_id=516)
        assert batch["image_grid_thw"].tolist() == theirs["image_grid_thw"]
        pixels = batch["pixel_values"]
        assert list(pixels.shape) == theirs["pixel_values"]["shape"]
        # 2.jpg (300 x 199) is resized to 308 x 196 by the processor: Pillow 13's bicubic (ferry's venv) and 11's
        # (LLaMA-Factory's) round a few pixels apart, 8.5e-5 of the sum; the other images are equal to the bit.
        assert float(pixels.double().sum()) == pytest.approx(theirs["pixel_values"]["sum"], rel=2e-4)
        assert _weighted(pixels) == pytest.approx(theirs["pixel_values"]["weighted"], rel=2e-4)
        types = batch["mm_token_type_ids"][0].tolist()
        assert sum(types) == sum(t * h * w // 4 for t, h, w in theirs["image_grid_thw"])
        assert all((tok == 516) == bool(kind) for tok, kind in zip(ours["input_ids"], types))


def _mllm(folder: Path, sdist_data: Path, rows: list[dict]) -> Path:
    """A dataset folder holding LLaMA-Factory's three JPEGs and ``rows`` as mllm_demo."""
    shutil.copytree(sdist_data / "mllm_demo_data", folder / "mllm_demo_data")
    (folder / "mllm.json").write_text(json.dumps(rows))
    info = {
        "mllm": {
            "file_name": "mllm.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        }
    }
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def _row(user: str, *images: str) -> dict:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "Two players."}],
        "images": list(images),
    }


GOOD = "mllm_demo_data/1.jpg"


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([_row("<image>Who?", "mllm_demo_data/9.jpg")], r"mllm\.json: row 1: image .*9\.jpg does not exist"),
        ([_row("<image>Who?", GOOD), _row("<image>Who?", "broken.jpg")], r"row 2: image .*broken\.jpg cannot be read"),
        ([_row("<image><image>Who?", GOOD)], r"row 1: 2 <image> placeholder\(s\) in the messages but 1 image"),
        ([_row("Who?", GOOD)], r"row 1: 0 <image> placeholder\(s\) in the messages but 1 image"),
        ([_row("<video>Who?")], r"row 1: a <video> placeholder"),
        ([{**_row("<image>Who?"), "images": [{"bytes": None}]}], r"row 1: images entry is dict, neither a file path"),
    ],
    ids=["missing", "corrupt", "more-placeholders", "fewer-placeholders", "video", "inline"],
)
def test_bad_image_rows_are_refused_naming_the_row(rows, expected, sdist_data, processors, tmp_path: Path) -> None:
    folder = _mllm(tmp_path / "data", sdist_data, rows)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    cfg = _cfg(processors["qwen2_vl"], folder, tmp_path, dataset=["mllm"], template="qwen2_vl")
    with pytest.raises(DataError, match=expected):
        prepare_data(cfg, load_tokenizer(cfg))
    assert not list((tmp_path / "tok").glob("*.safetensors"))  # nothing cached


def test_a_sample_the_cutoff_would_cut_through_an_image_is_dropped_and_counted(
    sdist_data, processors, tmp_path
) -> None:
    """66 image tokens: a cutoff inside them drops the sample (never features that do not fit the tokens); a
    cutoff after the image keeps it, cut in its text."""
    folder = _mllm(tmp_path / "data", sdist_data, [_row("<image>Who?", GOOD), _row("Who are they? " * 20)])
    for cutoff, dropped in ((40, 1), (200, 0)):
        cfg = _cfg(
            processors["qwen2_vl"], folder, tmp_path / str(cutoff), dataset=["mllm"], template="qwen2_vl",
            cutoff_len=cutoff,
        )  # fmt: skip
        data = prepare_data(cfg, load_tokenizer(cfg))
        assert data.stats["num_dropped_image_cut"] == dropped
        assert len(data.train) == 2 - dropped
        assert data.stats["num_images"] == 1 - dropped
        report = LaunchReport(
            config=cfg.resolved_dict(), world_size=1, nproc_per_node=1, nnodes=1, global_batch_size=1,
            steps_per_epoch=1, total_steps=1, num_train_samples=len(data.train), num_eval_samples=0,
            num_dropped_samples=0, tokens_per_step=1.0, trainable_params=0, total_params=0, command=[],
            dry_run=True, data_stats=dict(data.stats),
        )  # fmt: skip
        line = f"images:              {1 - dropped} (samples dropped, cutoff_len would cut an image: {dropped})"
        assert line in report.summary().splitlines()


def test_image_rows_refuse_what_they_cannot_go_with(sdist_data, processors, tmp_path: Path) -> None:
    """A template without image slots, a model folder without an image processor, packing, another stage: one
    line each, naming the key."""
    folder = _mllm(tmp_path / "data", sdist_data, [_row("<image>Who?", GOOD)])
    model = processors["qwen2_vl"]
    bare = shutil.copytree(model, tmp_path / "no-processor", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    cases = [
        (model, {"template": "qwen"}, r"template 'qwen' has no image slots: set template: to the model's"),
        (bare, {"template": "qwen2_vl"}, r"image rows need the model's image processor, and .*no-processor has none"),
        (model, {"template": "qwen2_vl", "packing": True}, r"packing: true with image or video rows"),
        (model, {"template": "qwen2_vl", "stage": "pt"}, r"stage pt trains text rows only"),
    ]
    for k, (where, keys, expected) in enumerate(cases):
        cfg = _cfg(where, folder, tmp_path / str(k), dataset=["mllm"], **keys)
        with pytest.raises(ConfigError, match=expected):
            prepare_data(cfg, load_tokenizer(cfg))


def test_the_cache_follows_the_image_bytes_and_the_pixel_keys(
    sdist_data, processors, tmp_path: Path, monkeypatch
) -> None:
    """Rewriting an image, changing image_max_pixels, or the same files in another folder (the entry holds the
    images' paths) builds a new cache entry; the same inputs load it without parsing a row (the images a data file
    names are remembered by its content); rows that name another image are read again."""
    import trainer.data

    folder = _mllm(tmp_path / "data", sdist_data, [_row("<image>Who?", GOOD)])
    cfg = _cfg(processors["qwen2_vl"], folder, tmp_path, dataset=["mllm"], template="qwen2_vl")
    tokenizer = load_tokenizer(cfg)
    first = prepare_data(cfg, tokenizer)

    def no_rows(*args, **kwargs):
        raise AssertionError("a start whose data did not change parses no row")

    with monkeypatch.context() as patch:
        patch.setattr(trainer.data, "iter_rows", no_rows)
        again = prepare_data(cfg, tokenizer)
    assert again.stats["cache_hit"] and again.train.images == first.train.images
    other = shutil.copyfile(sdist_data / "mllm_demo_data" / "3.jpg", folder / "mllm_demo_data" / "other.jpg")
    (folder / "mllm.json").write_text(json.dumps([_row("<image>Who?", "mllm_demo_data/other.jpg")]))
    renamed = prepare_data(cfg, tokenizer)
    assert not renamed.stats["cache_hit"] and renamed.train.images == [[str(other)]]
    (folder / "mllm.json").write_text(json.dumps([_row("<image>Who?", GOOD)]))
    assert prepare_data(cfg, tokenizer).stats["cache_key"] == first.stats["cache_key"]
    shutil.copyfile(sdist_data / "mllm_demo_data" / "2.jpg", folder / GOOD)
    changed = prepare_data(cfg, tokenizer)
    assert not changed.stats["cache_hit"] and changed.stats["cache_key"] != first.stats["cache_key"]
    smaller = prepare_data(cfg.model_copy(update={"image_max_pixels": 64 * 64}), tokenizer)
    assert not smaller.stats["cache_hit"]
    assert smaller.train.num_tokens() < changed.train.num_tokens()
    moved = shutil.copytree(folder, tmp_path / "moved")
    shutil.rmtree(folder)
    elsewhere = prepare_data(cfg.model_copy(update={"dataset_dir": str(moved)}), tokenizer)
    assert not elsewhere.stats["cache_hit"]
    assert all(Path(p).is_file() and Path(p).is_relative_to(moved) for p in elsewhere.train.images[0])


@pytest.mark.parametrize("case", ["qwen2_vl", "qwen3_vl_nothink"])
def test_the_written_chat_template_renders_an_image_part_as_training_did(
    case, sdist_data, processors, tmp_path
) -> None:
    """The chat_template.jinja ferry writes into the adapter (and the export), read by transformers' own
    apply_chat_template: a conversation whose user turn holds an ``image`` content part renders, up to the last
    reply, the text training rendered for the row with ``<image>`` as one slot (which Qwen-VL processors expand to
    the image's tokens, as training expanded it: the golden test above); a video part is its slot; another part
    kind is refused."""
    from trainer.data import template_for
    from trainer.templates import training_prompt_text

    golden = GOLDEN["cases"][case]
    cfg = _cfg(processors[golden["family"]], sdist_data, tmp_path, **golden["keys"])
    tokenizer = load_tokenizer(cfg)
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    for row in json.loads((sdist_data / "mllm_demo.json").read_text()):
        parts_messages, text_messages = [], []
        for message in row["messages"]:
            text = message["content"]
            parts: list[dict] = []
            for k, piece in enumerate(text.split("<image>")):
                parts += ([{"type": "image"}] if k else []) + ([{"type": "text", "text": piece}] if piece else [])
            parts_messages.append({"role": message["role"], "content": parts})
            text_messages.append({"role": message["role"], "content": text.replace("<image>", slot)})
        rendered = tokenizer.apply_chat_template(parts_messages[:-1], tokenize=False, add_generation_prompt=True)
        trained = training_prompt_text(
            template_for(cfg), text_messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
        )
        assert rendered == trained
        assert rendered.count(slot) == sum(m["content"].count("<image>") for m in row["messages"][:-1])
    video = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)
    # the processor expands the pad (per frame, with times, for Qwen3-VL's templates): tests/trainer/test_video.py
    timed = golden["keys"]["template"].startswith("qwen3")
    assert ("<|video_pad|>" if timed else "<|vision_start|><|video_pad|><|vision_end|>") in video
    assert video.count("<|vision_start|>") == (0 if timed else 1)
    with pytest.raises(Exception, match="renders text only, not a content part of type audio"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


def _preference_rows(golden: dict, stage: str, sdist_data: Path, processors, tmp_path: Path) -> tuple[Path, list]:
    """``(folder, rows)``: the preference folder of tests/support/vlm.py tokenised for ``stage`` as ``golden`` says
    (two rows per golden row: chosen and rejected, or judged and its KL row), its images counted as LF's."""
    folder = preference_folder(tmp_path / "data", sdist_data)
    cfg = _cfg(processors[golden["family"]], folder, tmp_path, stage=stage, **golden["keys"])
    data = prepare_data(cfg, load_tokenizer(cfg))
    rows = list(data.train)
    assert len(rows) == 2 * len(golden["rows"])
    assert data.stats["num_images"] == sum(len(r["images"]) for r in golden["rows"])
    return folder, rows


@pytest.mark.parametrize("case", list(GOLDEN["dpo"]))
def test_image_ranking_pairs_equal_llamafactory(case: str, sdist_data: Path, processors, tmp_path: Path) -> None:
    """stage dpo on ranking rows whose prompts hold images: both rows of every pair, token for token, as
    LLaMA-Factory's pairwise processor makes them (the prompt's placeholders expanded, labels on the replies only),
    each row keeping the pair's images."""
    golden = GOLDEN["dpo"][case]
    folder, rows = _preference_rows(golden, "dpo", sdist_data, processors, tmp_path)
    for k, theirs in enumerate(golden["rows"]):
        chosen, rejected = rows[2 * k], rows[2 * k + 1]
        assert chosen["input_ids"] == theirs["chosen_input_ids"] and chosen["labels"] == theirs["chosen_labels"]
        assert rejected["input_ids"] == theirs["rejected_input_ids"]
        assert rejected["labels"] == theirs["rejected_labels"]
        images = [Path(p).relative_to(folder).as_posix() for p in chosen["images"]]
        assert images == theirs["images"] and rejected["images"] == chosen["images"]


def test_images_stored_inline_train_as_their_files_do(sdist_data, processors, monkeypatch, tmp_path: Path) -> None:
    """A parquet file whose images column is a ``datasets`` Image feature (the bytes inline, as hub datasets store
    them): the same tokens and the same pixels as the JSON rows naming the files; the bytes are kept once, by hash,
    in the image store."""
    import datasets

    from trainer.vision import ImageProcessing

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    rows = json.loads((sdist_data / "mllm_demo.json").read_text())[:3]
    folder = _mllm(tmp_path / "files", sdist_data, rows)
    inline = tmp_path / "inline"
    inline.mkdir()
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = datasets.Features({"messages": datasets.List(message), "images": datasets.List(datasets.Image())})
    table = {
        "messages": [r["messages"] for r in rows],
        "images": [[{"bytes": (sdist_data / p).read_bytes(), "path": None} for p in r["images"]] for r in rows],
    }
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(inline / "mllm.parquet"))
    info = json.loads((folder / "dataset_info.json").read_text())
    info["mllm"]["file_name"] = "mllm.parquet"
    (inline / "dataset_info.json").write_text(json.dumps(info))
    model = processors["qwen2_vl"]
    by_file = _cfg(model, folder, tmp_path / "a", dataset=["mllm"], template="qwen2_vl")
    by_bytes = _cfg(model, inline, tmp_path / "b", dataset=["mllm"], template="qwen2_vl")
    tokenizer = load_tokenizer(by_file)
    ours, theirs = prepare_data(by_bytes, tokenizer), prepare_data(by_file, tokenizer)
    processing = ImageProcessing(model)
    stored = sorted((tmp_path / "cache" / "images").iterdir())
    assert len(stored) == 3  # 1.jpg twice in row 1: kept once
    for a, b in zip(ours.train, theirs.train, strict=True):
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
        assert all(Path(p).parent == tmp_path / "cache" / "images" for p in a["images"])
        pa, pb = processing.inputs(a["images"]), processing.inputs(b["images"])
        assert torch.equal(pa["pixel_values"], pb["pixel_values"])


def test_image_feedback_rows_equal_llamafactory(sdist_data: Path, processors, tmp_path: Path) -> None:
    """stage kto on feedback rows whose prompts hold images: every judged row and its KL row (the row's prompt with
    another row's reply), token for token, as LLaMA-Factory's feedback processor makes them, both keeping the
    row's images."""
    golden = GOLDEN["kto"]["kto-qwen2_vl"]
    folder, rows = _preference_rows(golden, "kto", sdist_data, processors, tmp_path)
    for k, theirs in enumerate(golden["rows"]):
        judged, kl = rows[2 * k], rows[2 * k + 1]
        assert judged["input_ids"] == theirs["input_ids"] and judged["labels"] == theirs["labels"]
        assert kl["input_ids"] == theirs["kl_input_ids"] and kl["labels"] == theirs["kl_labels"]
        assert judged["kto_tag"] == int(theirs["kto_tags"]) and kl["kto_tag"] == -1
        images = [Path(p).relative_to(folder).as_posix() for p in judged["images"]]
        assert images == theirs["images"] and kl["images"] == judged["images"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_image_token_counts_come_from_the_processor_without_pixels_and_equal_its_grid(
    family, sdist_data, processors
) -> None:
    """Tokenisation counts each image's tokens with the processor's own ``get_number_of_image_patches`` on the
    regularised size (no pixels computed); for every mllm_demo JPEG under LLaMA-Factory's default bounds and two
    tighter ones, that equals ``t * h * w / merge**2`` of the grid the processor makes from the pixels, which is
    also what a processor without that method is counted by."""
    from trainer.vision import ImageProcessing

    paths = [str(p) for p in sorted((sdist_data / "mllm_demo_data").glob("*.jpg"))]
    assert len(paths) >= 3
    for max_pixels, min_pixels in ((768 * 768, 32 * 32), (128 * 128, 32 * 32), (64 * 64, 56 * 56)):
        processing = ImageProcessing(processors[family], max_pixels, min_pixels)
        grid = processing.inputs(paths, "row")["image_grid_thw"]
        from_grid = [int(n) for n in (grid.prod(dim=-1) // processing.merge_size**2).tolist()]
        assert processing.token_counts(paths, "row") == from_grid
        processing.processor.get_number_of_image_patches = None  # a processor without the method
        assert processing.token_counts(paths, "row") == from_grid


@pytest.mark.parametrize("bounds", [(768 * 768, 32 * 32), (128 * 128, 32 * 32), (256 * 256, 400 * 400)])
def test_the_regularised_size_from_numbers_alone_is_the_resized_images(bounds) -> None:
    """``regularized_size`` (what video token counts use, from a file's header) equals the size
    ``regularize_image`` resizes to, step by step, over shapes that take every step: large, tiny, thin either way,
    palette mode."""
    from PIL import Image

    from trainer.vision import regularize_image, regularized_size

    for size in [(300, 199), (640, 360), (20, 20), (12, 3000), (3000, 12), (5, 9000), (9000, 5), (1, 1)]:
        for mode in ("RGB", "P"):
            image = regularize_image(Image.new(mode, size), *bounds)
            assert image.mode == "RGB" and image.size == regularized_size(*size, *bounds), (size, mode)
