"""The bundle's SBOM (``sbom.cdx.json``): CycloneDX 1.6 written with cyclonedx-python-lib and validated with
that library's own JSON-schema validator; wheels, models and datasets with purls, licences and every file's
sha256, all equal to what the manifest says."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from bundler.pack import pack
from bundler.sbom import build_sbom, sbom_bound, wheel_metadata
from bundler.spec import load_spec


def _valid(text: str) -> None:
    # imported here: the validator loads its JSON schemas (about 3 CPU-s), which every xdist worker would pay when
    # it collects this file
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    assert errors is None, errors


def test_sbom_of_a_reviewed_bundle_is_valid_cyclonedx_1_6(review_bundle: dict) -> None:
    bundle = review_bundle["dir"]
    text = (bundle / "sbom.cdx.json").read_text()
    _valid(text)
    sbom = json.loads(text)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert (sbom["bomFormat"], sbom["specVersion"]) == ("CycloneDX", "1.6")
    assert (
        sbom["serialNumber"] == f"urn:uuid:{manifest['bundle_id'][:8]}-{manifest['bundle_id'][8:12]}-"
        f"{manifest['bundle_id'][12:16]}-{manifest['bundle_id'][16:20]}-{manifest['bundle_id'][20:]}"
    )
    assert sbom["metadata"]["component"]["name"] == "review"
    assert {t["name"] for t in sbom["metadata"]["tools"]["components"]} == {"ferry"}
    # the manifest vouches for the SBOM's bytes
    entry = next(f for f in manifest["support_files"] if f["path"] == "sbom.cdx.json")
    assert entry["sha256"] == hashlib.sha256(text.encode()).hexdigest()

    by_ref = {c["bom-ref"]: c for c in sbom["components"]}
    items = {i["path"]: i for i in manifest["items"]}
    # wheels: library, pypi purl, sha256 of the wheel, licence from its METADATA
    wheels = {f["path"]: f for f in items["wheels"]["files"]}
    six = by_ref["wheel:six-1.17.0-py2.py3-none-any.whl"]
    assert (six["type"], six["name"], six["version"], six["purl"]) == (
        "library",
        "six",
        "1.17.0",
        "pkg:pypi/six@1.17.0",
    )
    assert six["hashes"] == [{"alg": "SHA-256", "content": wheels["six-1.17.0-py2.py3-none-any.whl"]["sha256"]}]
    assert six["licenses"] == [{"license": {"id": "MIT"}}]
    idna = by_ref["wheel:idna-3.10-py3-none-any.whl"]
    assert idna["purl"] == "pkg:pypi/idna@3.10" and idna["licenses"] == [{"license": {"name": "BSD License"}}]
    # models: machine-learning-model, huggingface purl at the resolved commit, licence from the card
    stories = items["models/hf/stories/stories260K"]
    model = by_ref["model:models/hf/stories/stories260K"]
    assert model["type"] == "machine-learning-model" and model["version"] == stories["revision"]
    assert model["purl"] == f"pkg:huggingface/stories/stories260K@{stories['revision']}"
    assert model["licenses"] == [{"license": {"id": "MIT"}}]
    assert {c["name"]: c["hashes"][0]["content"] for c in model["components"]} == {
        f["path"]: f["sha256"] for f in stories["files"]
    }
    assert all(c["type"] == "file" for c in model["components"])
    remote = by_ref["model:models/hf/acme/remote-code"]
    assert {"name": "ferry:trust_remote_code", "value": "true"} in remote["properties"]
    # datasets: data components with their files
    alpaca = items["datasets/hf/llamafactory/alpaca_en_demo"]
    data = by_ref["dataset:datasets/hf/llamafactory/alpaca_en_demo"]
    assert data["type"] == "data" and data["version"] == alpaca["revision"]
    assert {c["name"]: c["hashes"][0]["content"] for c in data["components"]} == {
        f["path"]: f["sha256"] for f in alpaca["files"]
    }
    # the bundle depends on every component
    root = next(d for d in sbom["dependencies"] if d["ref"] == sbom["metadata"]["component"]["bom-ref"])
    assert set(root["dependsOn"]) == set(by_ref)


def test_sbom_is_in_the_archive_head_and_equal_to_the_directory_copy(review_bundle: dict) -> None:
    with tarfile.open(review_bundle["tar"]) as tar:
        names = tar.getnames()
        assert names.index("review/sbom.cdx.json") == 2  # manifest.json, manifest.json.sig, sbom.cdx.json
        assert tar.extractfile("review/sbom.cdx.json").read() == (review_bundle["dir"] / "sbom.cdx.json").read_bytes()


def test_sbom_bound_holds_and_local_items_validate(
    tmp_path: Path, stories_model: Path, llamafactory_data: Path
) -> None:
    result = pack(
        load_spec(name="loc", models=[str(stories_model)], datasets=[str(llamafactory_data)], no_wheels=True),
        tmp_path / "out",
        progress=False,
    )
    text = (result.bundle_dir / "sbom.cdx.json").read_text()
    _valid(text)
    sbom = json.loads(text)
    assert all("purl" not in c for c in sbom["components"])  # local sources have no purl
    manifest = result.manifest
    assert len(text.encode()) <= sbom_bound(manifest)
    assert build_sbom(manifest).decode() == text  # a pure function of the manifest


def test_wheel_licence_sources(tmp_path: Path) -> None:
    import zipfile

    def wheel(name: str, metadata: str) -> Path:
        path = tmp_path / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(
                f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\n{metadata}"
            )
        return path

    assert (
        wheel_metadata(wheel("a", "License-Expression: Apache-2.0 OR MIT\nLicense: long\n"))["license"]
        == "Apache-2.0 OR MIT"
    )
    assert wheel_metadata(wheel("b", "License: BSD-3-Clause\n"))["license"] == "BSD-3-Clause"
    long_text = "Copyright (c) someone\n        Permission is hereby granted " + "x" * 200
    assert (
        wheel_metadata(wheel("c", f"License: {long_text}\nClassifier: License :: OSI Approved :: MIT License\n"))[
            "license"
        ]
        == "MIT License"
    )
    assert wheel_metadata(wheel("d", ""))["license"] is None
