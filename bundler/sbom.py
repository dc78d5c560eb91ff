"""The bundle's SBOM: ``sbom.cdx.json``, CycloneDX 1.6 JSON written with ``cyclonedx-python-lib``.

Components (top level), each with its files' sha256:

* every wheel: ``library``, purl ``pkg:pypi/NAME@VERSION``, sha256 of the wheel, licence from the wheel's
  METADATA (``License-Expression``, else a short ``License`` field, else the ``License ::`` classifiers);
* every model: ``machine-learning-model``, purl ``pkg:huggingface/ORG/NAME@COMMIT`` (Hugging Face sources;
  ModelScope and local ones carry none), version = the resolved revision, licence from the model card;
* every dataset: ``data``, the same purl rules;
* each model or dataset file: a nested ``file`` component with its sha256.

The bundle itself is ``metadata.component`` (``application``, version = bundle_id) and depends on every
component; ``metadata.tools`` names ferry. The serial number is derived from the bundle_id and the
timestamp is the manifest's ``created``, so the SBOM is a pure function of the manifest and the wheels.

Validate with the library's own schema validator (``JsonStrictValidator(SchemaVersion.V1_6)``), as
tests/bundler/test_sbom.py does.
"""

from __future__ import annotations

import email.parser
import re
import uuid
import warnings
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferry.errors import SourceError

if TYPE_CHECKING:  # (cyclonedx is imported when an SBOM is built)
    from cyclonedx.contrib.license.factories import LicenseFactory
    from cyclonedx.model import HashType
    from cyclonedx.model.component import Component

#: Longest free-text ``License:`` field taken as a licence name (longer ones are whole licence texts).
MAX_LICENSE_NAME = 100
_PLACEHOLDER_SHA = "0" * 64


def wheel_metadata(path: str | Path) -> dict[str, str | None]:
    """``{"name", "version", "license"}`` of a wheel, read from its ``*.dist-info/METADATA``.

    ``license`` is ``License-Expression`` (PEP 639), else the ``License`` field when it is one short line,
    else the ``License ::`` trove classifiers joined with `` AND ``... (their last part), else None.

    Raises:
        SourceError: not a wheel (no METADATA).
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if not names:
                raise SourceError(f"{path.name}: no *.dist-info/METADATA (not a wheel)")
            text = zf.read(names[0]).decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError) as exc:
        raise SourceError(f"{path.name}: cannot read the wheel: {exc}") from None
    meta = email.parser.Parser().parsestr(text, headersonly=True)
    licence = (meta.get("License-Expression") or "").strip() or None
    if licence is None:
        field = (meta.get("License") or "").strip()
        if field and "\n" not in field and len(field) <= MAX_LICENSE_NAME and field.upper() not in ("UNKNOWN",):
            licence = field
    if licence is None:
        classifiers = [
            c.split("::")[-1].strip()
            for c in meta.get_all("Classifier") or []
            if c.startswith("License ::") and c.count("::") >= 2
        ]
        if classifiers:
            licence = " AND ".join(dict.fromkeys(classifiers))[:MAX_LICENSE_NAME]
    return {"name": meta.get("Name"), "version": meta.get("Version"), "license": licence}


def build_sbom(manifest: dict[str, Any], wheels: dict[str, dict[str, str | None]] | None = None) -> bytes:
    """CycloneDX 1.6 JSON (UTF-8 bytes, ending in a newline) describing the bundle ``manifest``.

    ``manifest``: a ferry manifest (bundler/format.py) with at least ``name``, ``bundle_id``, ``created``,
    ``ferry_version`` and ``items``; ``wheels``: wheel file name -> :func:`wheel_metadata` (wheel files
    absent from it get name and version from the file name and no licence).
    """
    from cyclonedx.contrib.license.factories import LicenseFactory
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.output.json import JsonV1Dot6

    licences = LicenseFactory()
    wheels = wheels or {}
    components: list[Component] = []
    for item in manifest["items"]:
        if item["kind"] == "wheels":
            components += _wheel_components(item, wheels, licences)
        else:
            components.append(_item_component(item, licences))
    root = Component(
        type=ComponentType.APPLICATION,
        name=manifest["name"],
        version=manifest["bundle_id"],
        bom_ref=f"bundle:{manifest['bundle_id']}",
        description="ferry bundle",
    )
    tool = Component(type=ComponentType.APPLICATION, name="ferry", version=manifest.get("ferry_version"))
    created = datetime.strptime(manifest["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    bom = Bom(
        components=components,
        serial_number=uuid.UUID(hex=manifest["bundle_id"]),
        metadata=BomMetaData(component=root, timestamp=created),
    )
    bom.metadata.tools.components.add(tool)
    bom.register_dependency(root, components)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lib warns about components without dependencies of their own
        text = JsonV1Dot6(bom).output_as_string(indent=1)
    return (text + "\n").encode("utf-8")


def _sha(digest: str) -> list[HashType]:
    """The hashes of a component whose sha256 is ``digest`` (hex)."""
    from cyclonedx.model import HashAlgorithm, HashType

    return [HashType(alg=HashAlgorithm.SHA_256, content=digest)]


def _licences(licences: LicenseFactory, value: str | None) -> list:
    """The licences of a component: ``value`` (an SPDX expression or a name) read by ``licences``; none when
    unknown."""
    return [licences.make_from_string(value)] if value else []


def _wheel_components(
    item: dict[str, Any], wheels: dict[str, dict[str, str | None]], licences: LicenseFactory
) -> list[Component]:
    """One ``library`` component per wheel file of the wheels ``item``: name, version and licence from ``wheels``
    (else name and version from the file name), purl ``pkg:pypi/NAME@VERSION``, the wheel's sha256."""
    from cyclonedx.model import Property
    from cyclonedx.model.component import Component, ComponentType
    from packageurl import PackageURL

    components = []
    for entry in item["files"]:
        if not entry["path"].endswith(".whl"):
            continue
        meta = wheels.get(entry["path"]) or {}
        parts = entry["path"][:-4].split("-")
        name = meta.get("name") or parts[0]
        version = meta.get("version") or (parts[1] if len(parts) > 1 else None)
        components.append(
            Component(
                type=ComponentType.LIBRARY,
                name=name,
                version=version,
                bom_ref=f"wheel:{entry['path']}",
                purl=PackageURL(type="pypi", name=_pypi_name(name), version=version),
                hashes=_sha(entry["sha256"]),
                licenses=_licences(licences, meta.get("license")),
                properties=[Property(name="ferry:file", value=f"{item['path']}/{entry['path']}")],
            )
        )
    return components


def _item_component(item: dict[str, Any], licences: LicenseFactory) -> Component:
    """The component of a model (``machine-learning-model``) or dataset (``data``) ``item``: version the resolved
    revision, a huggingface purl for Hugging Face sources, one nested ``file`` component per file with its sha256,
    and ferry's properties (source, path, requested revision, trust_remote_code)."""
    from cyclonedx.model import Property
    from cyclonedx.model.component import Component, ComponentType
    from packageurl import PackageURL

    repo_id = item.get("repo_id") or item["path"]
    kind = ComponentType.MACHINE_LEARNING_MODEL if item["kind"] == "model" else ComponentType.DATA
    purl = None
    if item["source"] == "hf" and "/" in repo_id:
        org, name = repo_id.split("/", 1)
        purl = PackageURL(
            type="huggingface",
            namespace=org,
            name=name,
            version=item.get("revision"),
            qualifiers={"repository_type": "dataset"} if item["kind"] == "dataset" else None,
        )
    files = [
        Component(
            type=ComponentType.FILE,
            name=entry["path"],
            hashes=_sha(entry["sha256"]),
            bom_ref=f"file:{item['path']}/{entry['path']}",
        )
        for entry in item["files"]
    ]
    props = [Property(name="ferry:source", value=item["source"]), Property(name="ferry:path", value=item["path"])]
    if item.get("revision_requested"):
        props.append(Property(name="ferry:revision_requested", value=str(item["revision_requested"])))
    if item.get("trust_remote_code"):
        props.append(Property(name="ferry:trust_remote_code", value="true"))
    return Component(
        type=kind,
        name=repo_id,
        version=item.get("revision"),
        bom_ref=f"{item['kind']}:{item['path']}",
        purl=purl,
        licenses=_licences(licences, item.get("license")),
        components=files,
        properties=props,
    )


def sbom_bound(manifest: dict[str, Any], wheels: dict[str, dict[str, str | None]] | None = None) -> int:
    """Upper bound in bytes of :func:`build_sbom` for this manifest once its digests are known: the SBOM of a
    copy with every sha256 and revision replaced by placeholders of the same length, plus slack."""
    import copy

    placeholder = copy.deepcopy(manifest)
    for item in placeholder["items"]:
        if item.get("revision") is None and item["kind"] != "wheels":
            item["revision"] = "0" * 40
        for entry in item["files"]:
            entry["sha256"] = _PLACEHOLDER_SHA
    size = len(build_sbom(placeholder, wheels))
    return size + size // 20 + 4096


def _pypi_name(name: str) -> str:
    """PEP 503 normalised name, as purl's pypi type wants."""
    return re.sub(r"[-_.]+", "-", name).lower()
