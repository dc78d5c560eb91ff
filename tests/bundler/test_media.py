"""Images a local dataset's rows name (LLaMA-Factory's mllm_demo layout): packed with the folder, counted in the
manifest and by ``ferry inspect``, and every image the isolated host would not have refused on the online side in
one line naming the data file, the row and the path. The images are real PNG and JPEG files written by Pillow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from bundler.inspect import inspect
from bundler.media import check_media
from bundler.pack import pack
from bundler.spec import load_spec
from ferry.errors import SourceError


def _mllm(folder: Path, rows: list[dict], suffix: str = ".json") -> Path:
    """A dataset folder in mllm_demo's layout: two real images, ``rows`` in ``mllm_demo{suffix}``."""
    (folder / "mllm_demo_data").mkdir(parents=True)
    Image.new("RGB", (16, 12), (200, 30, 30)).save(folder / "mllm_demo_data" / "1.jpg", "JPEG")
    Image.new("RGB", (8, 8), (0, 90, 200)).save(folder / "mllm_demo_data" / "2.png", "PNG")
    info = {
        "mllm_demo": {
            "file_name": f"mllm_demo{suffix}",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        }
    }
    (folder / "dataset_info.json").write_text(json.dumps(info))
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
    (folder / f"mllm_demo{suffix}").write_text(text)
    return folder


def _row(*images: str) -> dict:
    turn = [
        {"role": "user", "content": "<image>" * len(images) + "Who are they?"},
        {"role": "assistant", "content": "x"},
    ]
    return {"messages": turn, **({"images": list(images)} if images else {})}


ROWS = [_row("mllm_demo_data/1.jpg"), _row(), _row("mllm_demo_data/2.png", "mllm_demo_data/1.jpg")]


def test_images_travel_with_the_rows_and_are_counted(tmp_path: Path) -> None:
    folder = _mllm(tmp_path / "mllm", ROWS)
    spec = load_spec(name="images", datasets=[str(folder)])
    spec.wheels.no_wheels = True
    result = pack(spec, tmp_path / "out", progress=False)
    item = next(i for i in result.manifest["items"] if i["kind"] == "dataset")
    sizes = {p: (folder / p).stat().st_size for p in ("mllm_demo_data/1.jpg", "mllm_demo_data/2.png")}
    assert item["media"] == {"images": 2, "videos": 0, "bytes": sum(sizes.values())}  # distinct: 1.jpg named twice
    assert {f["path"] for f in item["files"]} >= set(sizes)
    assert "images     local/mllm: 2 image(s)" in inspect(result.bundle_dir).text()


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_an_image_the_isolated_host_would_not_have_is_refused_naming_row_and_path(tmp_path: Path, suffix) -> None:
    folder = _mllm(tmp_path / "mllm", ROWS, suffix)
    carried = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert check_media(folder, carried) == {
        "images": 2,
        "videos": 0,
        "bytes": sum((folder / r).stat().st_size for r in carried if "data/" in r),
    }
    (tmp_path / "outside.png").write_bytes((folder / "mllm_demo_data" / "2.png").read_bytes())
    (folder / "mllm_demo_data" / "notes.jpg").write_text("not a picture")
    where = f"mllm/mllm_demo{suffix} row 1: image"
    cases = [
        (
            "mllm_demo_data/3.jpg",
            carried,
            f"{where} 'mllm_demo_data/3.jpg' does not exist ({folder}/mllm_demo_data/3.jpg)",
        ),
        ("../outside.png", carried, f"{where} '../outside.png' lies outside the dataset folder {folder}"),
        (str(tmp_path / "outside.png"), carried, f"{where} '{tmp_path}/outside.png' lies outside the dataset folder"),
        ("mllm_demo_data/2.png", carried - {"mllm_demo_data/2.png"}, f"{where} 'mllm_demo_data/2.png' is left out by"),
        (
            "mllm_demo_data/notes.jpg",
            carried | {"mllm_demo_data/notes.jpg"},
            f"{where} 'mllm_demo_data/notes.jpg' is not an image",
        ),
    ]
    for image, files, message in cases:
        rows = [ROWS[0], _row(image), ROWS[2]]
        text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
        (folder / f"mllm_demo{suffix}").write_text(text)
        with pytest.raises(SourceError) as err:
            check_media(folder, files)
        assert str(err.value).startswith(message), (str(err.value), message)
        assert "\n" not in str(err.value)


def test_llamafactorys_video_rows_travel_and_a_bad_video_is_refused(tmp_path: Path) -> None:
    """LLaMA-Factory 0.9.5's mllm_video_demo (its rows, its dataset_info.json entry and its MP4 and AVI files, from
    the hash-pinned sdist) packs with its videos counted and shown by ``ferry inspect``; a video that is missing or
    not a video (a JPEG renamed) is refused in one line naming the row."""
    import shutil

    from tests.support.pinned_sdist import LLAMAFACTORY

    sdist = LLAMAFACTORY.path() / "data"
    folder = tmp_path / "videos"
    (folder / "mllm_demo_data").mkdir(parents=True)
    rows = json.loads((sdist / "mllm_video_demo.json").read_text())
    for row in rows:
        for video in row["videos"]:
            shutil.copy(sdist / video, folder / video)
    (folder / "mllm_video_demo.json").write_text(json.dumps(rows))
    info = json.loads((sdist / "dataset_info.json").read_text())
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_video_demo": info["mllm_video_demo"]}))
    spec = load_spec(name="videos", datasets=[str(folder)])
    spec.wheels.no_wheels = True
    result = pack(spec, tmp_path / "out", progress=False)
    item = next(i for i in result.manifest["items"] if i["kind"] == "dataset")
    size = sum(p.stat().st_size for p in (folder / "mllm_demo_data").iterdir())
    assert item["media"] == {"images": 0, "videos": 3, "bytes": size}
    assert "images     local/videos: 0 image(s), 3 video(s)" in inspect(result.bundle_dir).text()
    shutil.copy(sdist / "mllm_demo_data" / "1.jpg", folder / "mllm_demo_data" / "photo.mp4")
    carried = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    where = "videos/mllm_video_demo.json row 1: video"
    for name, message in (("gone.mp4", "does not exist"), ("photo.mp4", "is not a video (MP4/MOV, AVI")):
        rows[1]["videos"] = [f"mllm_demo_data/{name}"]
        (folder / "mllm_video_demo.json").write_text(json.dumps(rows))
        with pytest.raises(SourceError, match=rf"^{where} 'mllm_demo_data/{name}' {re.escape(message)}"):
            check_media(folder, carried)


def test_a_folder_without_image_columns_has_no_media(tmp_path: Path, llamafactory_data: Path) -> None:
    assert check_media(llamafactory_data, {p.name for p in llamafactory_data.iterdir()}) is None
    assert check_media(tmp_path, set()) is None  # no dataset_info.json


def test_llamafactorys_own_mllm_demo_passes_and_its_vl_example_carries_torchvision(tmp_path: Path) -> None:
    """LLaMA-Factory 0.9.5's data folder (the hash-pinned sdist): mllm_demo's rows name its three JPEGs and the
    video entries' rows (mllm_video_demo, mllm_video_audio_demo) its MP4 and AVI files, all there; its
    qwen3vl_lora_sft.yaml example, which trains on mllm_demo, adds the vision extra (torchvision, PyAV) to a spec
    whose datasets hold that folder; its text-only qwen3_lora_sft.yaml does not."""
    import shutil

    from bundler.spec import TRAINING_REQUIREMENTS
    from tests.support.pinned_sdist import LLAMAFACTORY

    data = LLAMAFACTORY.path() / "data"
    carried = {p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file()}
    found = check_media(data, carried)
    jpegs = sorted(p for p in carried if p.startswith("mllm_demo_data/") and p.endswith(".jpg"))
    info = json.loads((data / "dataset_info.json").read_text())
    videos = {  # what the video entries' rows name, read here without ferry
        v
        for entry in info.values()
        if (entry.get("columns") or {}).get("videos")
        for row in json.loads((data / entry["file_name"]).read_text())
        for v in row[entry["columns"]["videos"]]
    }
    assert len(jpegs) == 3 and len(videos) == 4 and {v.rsplit(".", 1)[1] for v in videos} == {"mp4", "avi"}
    size = sum((data / p).stat().st_size for p in [*jpegs, *videos])
    assert found == {"images": len(jpegs), "videos": len(videos), "bytes": size}
    examples = LLAMAFACTORY.path() / "examples" / "train_lora"
    for name, expected in (("qwen3vl_lora_sft.yaml", ["vision"]), ("qwen3_lora_sft.yaml", [])):
        shutil.copy(examples / name, tmp_path / name)
        spec_file = tmp_path / f"spec-{name}"
        spec_file.write_text(f"name: kit\ndatasets: [{data}]\ntraining_config: {name}\n")
        assert load_spec(spec_file).training == expected, name
    assert TRAINING_REQUIREMENTS["vision"] == ["torchvision", "av"]


def test_the_vision_extra_resolves_the_torchvision_that_pins_the_sets_torch(tmp_path: Path, monkeypatch) -> None:
    """``ferry pack --extra vision --dry-run`` with torch 2.13.0 in the set resolves torchvision 0.28.0, the release
    built against it, and PyAV (a resolution only: nothing is downloaded)."""
    from click.testing import CliRunner

    from ferry.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    argv = ["pack", "--dry-run", "--name", "v", "--python-version", "3.11", "--platform", "x86_64-manylinux_2_28"]
    argv += ["--extra", "vision", "--requirements", str(tmp_path / "requirements.txt")]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1] for line in result.output.splitlines() if line.count(" ") > 3}
    assert rows.get("torchvision") == "0.28.0" and rows.get("torch") == "2.13.0", result.output[-2000:]
    assert "av" in rows, result.output[-2000:]  # PyAV, which decodes the video rows' files
