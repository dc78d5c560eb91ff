"""``ferry inspect``: look inside a bundle before installing, reading only its metadata head; the approvers'
HTML page rendered by a real headless Chromium (Debian's ``chromium``; ``make test`` installs it) with a
screenshot; ``ferry install`` prints the same risk flags first."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.inspect import inspect, write_html
from bundler.pack import pack
from bundler.spec import load_spec
from ferry.errors import BundleError
from tests.support.helpers import ROOT


def _ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_inspect_shows_signer_provenance_items_wheels_and_risks(review_bundle: dict) -> None:
    found = inspect(review_bundle["tar"], review_bundle["allowed"])
    manifest = json.loads((review_bundle["dir"] / "manifest.json").read_text())
    assert (found.manifest["name"], found.manifest["bundle_id"]) == ("review", manifest["bundle_id"])
    assert found.signature["status"] == "verified" and found.signature["principal"] == "alice@bank.example"
    data = found.to_json()
    assert data["provenance"]["ferry_version"] == manifest["ferry_version"]
    assert data["provenance"]["hf_endpoint"] == review_bundle["result"].manifest["provenance"]["hf_endpoint"]
    assert data["provenance"]["hf_endpoint"].startswith("http://127.0.0.1:")
    assert data["provenance"]["pip_index_urls"] and data["provenance"]["python"].count(".") == 2
    assert data["target"]["python"] == manifest["target"]["python"]
    items = {i["repo_id"]: i for i in found.items}
    stories = items["stories/stories260K"]
    assert (stories["source"], stories["revision_requested"], stories["license"]) == ("hf", "v1", "mit")
    assert len(stories["revision"]) == 40 and stories["files"] == 7
    remote = items["acme/remote-code"]
    assert remote["trust_remote_code"] and remote["python_files"] == ["modeling_acme.py"]
    assert remote["pickles_carried"] == ["acme_weights.pt"]
    assert items["llamafactory/alpaca_en_demo"]["kind"] == "dataset"
    assert {(w["name"], w["version"], w["license"]) for w in found.wheels} == {
        ("six", "1.17.0", "MIT"),
        ("idna", "3.10", "BSD License"),
    }
    totals = found.totals
    all_files = [
        f
        for i in manifest["items"]
        for f in i["files"]  # the wheels' lock files are not counted
        if i["kind"] != "wheels" or f["path"].endswith(".whl")
    ]
    assert totals["bytes"] == sum(f["size"] for f in all_files) and totals["files"] == len(all_files)
    # risk flags, most serious first; a verified signature raises none
    risks = found.risks
    assert not any("sign" in r for r in risks)
    assert risks[0].startswith("remote code: acme/remote-code") and "modeling_acme.py" in risks[0]
    assert risks[1].startswith("pickle files: acme/remote-code carries acme_weights.pt")
    assert risks[2].startswith("unknown licence:") and "acme/remote-code" in risks[2] and "alpaca_en_demo" in risks[2]
    # without pinned signers the signature is only seen, and that is a flag
    unchecked = inspect(review_bundle["tar"])
    assert unchecked.signature["status"] == "unchecked"
    assert unchecked.signature["key"] == found.signature["key"]
    assert unchecked.risks[0].startswith("signature not checked")


def test_inspect_reads_only_the_head(review_bundle: dict, tmp_path: Path, stories_model: Path) -> None:
    found = inspect(review_bundle["tar"])
    head = sum(
        len((review_bundle["dir"] / n).read_bytes()) for n in ("manifest.json", "manifest.json.sig", "sbom.cdx.json")
    )
    assert head <= found.bytes_read < head + 200 * 1024 < found.bundle_bytes
    # the first volume of a split bundle is enough, and the other volumes are not opened
    out = tmp_path / "out"
    pack(load_spec(name="vol", models=[str(stories_model)], no_wheels=True, split_size="300kB"), out, progress=False)
    for volume in sorted(out.glob("vol.ferry.tar.0*"))[1:]:
        volume.chmod(0)  # unreadable: opening one would fail (root ignores modes, so also rename them)
        volume.rename(volume.with_name(volume.name + ".away"))
    found = inspect(out / "vol.ferry.tar.000")
    assert found.manifest["name"] == "vol" and found.signature["status"] == "unsigned"
    assert found.risks[0].startswith("unsigned bundle")


def test_inspect_of_a_forged_bundle_flags_an_invalid_signature(review_bundle: dict, tmp_path: Path) -> None:
    forged = tmp_path / "review"
    shutil.copytree(review_bundle["dir"], forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["items"][0]["license"] = "apache-2.0"
    (forged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for allowed in (review_bundle["allowed"], None):
        found = inspect(forged, allowed)
        assert found.signature["status"] == "invalid"
        assert found.risks[0].startswith("invalid signature")


def test_inspect_cli_json_and_text(review_bundle: dict) -> None:
    proc = _ferry("inspect", str(review_bundle["tar"]), "--json", "--allowed-signers", str(review_bundle["allowed"]))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["signature"]["principal"] == "alice@bank.example" and len(data["items"]) == 3
    proc = _ferry("inspect", str(review_bundle["tar"]))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("RISK       signature not checked")
    assert any(line.startswith("signature  signed by ED25519 key SHA256:") for line in lines)
    assert re.search(r"^read +\S+ \S+ of \S+ \S+ \(\d+\.\d+ %\)$", proc.stdout, re.M)


def test_old_layout_is_refused_with_one_line(tmp_path: Path, review_bundle: dict) -> None:
    """An archive whose manifest is not at the head (made by a plain tar) is refused, not read in full."""
    archive = tmp_path / "plain.ferry.tar"
    subprocess.run(["tar", "-cf", str(archive), "--sort=name", "-C", str(review_bundle["out"]), "review"], check=True)
    with pytest.raises(BundleError) as exc:
        inspect(archive)
    assert "not among the first members" in str(exc.value) and "\n" not in str(exc.value)


def test_html_page_is_self_contained_and_renders_in_chromium(review_bundle: dict, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (make test installs it: apt-get install chromium)"
    page = write_html(inspect(review_bundle["tar"], review_bundle["allowed"]), tmp_path / "review.html")
    text = page.read_text()
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|\bhref=|url\(|@import", text, re.I)
    assert "default-src 'none'" in text
    # risk flags come before the tables
    assert text.index("Risk flags") < text.index("Models and datasets") < text.index("Wheels")
    shot = tmp_path / "review.png"
    base = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    proc = subprocess.run(
        [*base, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    for needle in (
        "Risk flags (3)",
        "remote code: acme/remote-code",
        "acme_weights.pt",
        "VERIFIED: signed by alice@bank.example",
        "stories/stories260K",
        "1.17.0",
    ):
        assert needle in dom, needle
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 900)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours and len(colours) > 50  # text was drawn, not a blank page
    risk_box = sum(n for n, rgb in colours if rgb == (255, 235, 233))
    assert risk_box > 20_000  # the pink risk box is on the first screen
    shutil.copy(shot, Path(os.environ.get("FERRY_SCREENSHOT_DIR", tmp_path)) / "inspect.png")


def test_ferry_install_prints_the_risk_flags_first(review_bundle: dict, tmp_path: Path) -> None:
    proc = _ferry("install", str(review_bundle["tar"]), "--prefix", str(tmp_path / "prefix"), "--no-venv", "-q")
    assert proc.returncode == 0, proc.stderr
    flags = [line for line in proc.stderr.splitlines() if line.startswith("RISK: ")]
    assert flags[0].startswith("RISK: signature not checked") and any("remote code" in f for f in flags)
    assert "installed" in proc.stdout
