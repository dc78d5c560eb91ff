"""``ferry inspect``: look inside a bundle before installing it, reading its metadata only.

An archive starts with manifest.json, its signature and sbom.cdx.json (bundler/format.py), so inspecting a
100 GB ``NAME.ferry.tar`` or its first volume ``NAME.ferry.tar.000`` reads about 100 kB plus 1 kB per file
(:func:`bundler.installer.signature.read_head`); ``bytes_read`` says how many.

What it shows (text, ``--json`` or a self-contained ``--html`` page for approvers), risk flags first:

* the bundle's name and id; the signature: verified (with ``allowed_signers``: the principal), present but
  not checked against pinned signers, invalid, or absent;
* provenance: ferry version, the packing host's Python and platform, hub endpoints, pip indexes, time;
* the target Python and platforms;
* every model and dataset: source, requested and resolved revision, files, bytes, licence,
  ``trust_remote_code`` with its .py files, pickle files skipped or carried;
* every wheel with version and licence (from the SBOM); totals;
* for a delta bundle (bundler/delta.py): its base (the sha256 of the base document), and per item and in
  total the bytes carried and the bytes reused from the base (the isolated host's files).

Risk flags: unsigned (or a signature not checked / invalid), remote code, pickle files carried, unknown
licences, an SBOM that does not match the manifest.

Nothing here proves the content matches the manifest: that is ``ferry verify`` (every byte). With
``allowed_signers`` the manifest shown is the one the signer signed.
"""

from __future__ import annotations

import hashlib
import html
import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bundler.format import PICKLE_SUFFIXES, SBOM_NAME
from bundler.installer.check import bundle_bytes
from bundler.installer.manifest import is_delta, parse_manifest
from bundler.installer.signature import read_head
from ferry.errors import BundleError, IntegrityError
from ferry.fsutil import atomic_write_text, format_bytes

#: Licence values that say nothing (lower case).
UNKNOWN_LICENCES = {"", "other", "unknown", "none", "proprietary", "noassertion"}


@dataclass
class Inspection:
    """What :func:`inspect` found. ``signature``: ``{"status": "verified" | "unchecked" | "invalid" |
    "unsigned" | "unavailable", "principal", "key", "source", "claimed", "detail"}``; ``items`` and
    ``wheels``: one dict per row (see :meth:`to_json`); ``bytes_read`` / ``bundle_bytes``: bytes read to
    inspect / the bundle's size, both in bytes."""

    bundle: Path
    manifest: dict[str, Any]
    signature: dict[str, Any]
    items: list[dict[str, Any]]
    wheels: list[dict[str, Any]]
    risks: list[str]
    bytes_read: int
    bundle_bytes: int
    sbom_components: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, int]:
        """``files`` and ``bytes`` of the models, datasets and wheels."""
        rows = [*self.items, *self.wheels]
        return {
            "items": len(self.items),
            "wheels": len(self.wheels),
            "files": sum(r["files"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows),
        }

    @property
    def delta(self) -> dict[str, Any] | None:
        """For a delta bundle: ``{"base", "carried_bytes", "reused_bytes", "full_bytes", "rows"}`` (bytes; rows:
        ``{"label", "files", "from_base", "rebuilt", "carried_bytes", "reused_bytes"}`` per item, wheels as one);
        None for a full bundle."""
        m = self.manifest
        if not is_delta(m):
            return None
        rows = []
        for item in m["items"]:
            files = item["files"]
            carried = sum(_carried_bytes(f) for f in files)
            full = sum(f["size"] for f in files)
            rows.append(
                {
                    "label": item.get("repo_id") or item["kind"],
                    "files": len(files),
                    "from_base": sum(1 for f in files if f.get("delta") == "from_base"),
                    "rebuilt": sum(1 for f in files if f.get("delta") == "tensors"),
                    "carried_bytes": carried,
                    "reused_bytes": full - carried,
                }
            )
        carried = sum(r["carried_bytes"] for r in rows)
        reused = sum(r["reused_bytes"] for r in rows)
        return {
            "base": m["base"],
            "carried_bytes": carried,
            "reused_bytes": reused,
            "full_bytes": carried + reused,
            "rows": rows,
        }

    def to_json(self) -> dict[str, Any]:
        """Everything shown, as JSON-ready data (``ferry inspect --json``)."""
        return {"delta": self.delta, **self._json()}

    def _json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "bundle": str(self.bundle),
            "name": m["name"],
            "bundle_id": m["bundle_id"],
            "created": m.get("created"),
            "format_version": m.get("format_version"),
            "signature": self.signature,
            "risks": self.risks,
            "provenance": {
                "ferry_version": m.get("ferry_version"),
                "host": m.get("host"),
                **(m.get("provenance") or {}),
            },
            "target": m.get("target"),
            "items": self.items,
            "wheels": self.wheels,
            "totals": self.totals,
            "bytes_read": self.bytes_read,
            "bundle_bytes": self.bundle_bytes,
            "notes": self.notes,
        }

    def text(self) -> str:
        """A plain-text report for the terminal, risk flags first."""
        m, sig = self.manifest, self.signature
        prov = {"ferry_version": m.get("ferry_version"), **(m.get("host") or {}), **(m.get("provenance") or {})}
        lines = [f"bundle     {m['name']} ({m['bundle_id']}), created {m.get('created')}"]
        lines += [f"RISK       {r}" for r in self.risks] or ["risks      none flagged"]
        lines.append(f"signature  {signature_line(sig)}")
        lines.append("provenance " + ", ".join(f"{k}={v}" for k, v in prov.items() if v not in (None, "", [])))
        target = m.get("target") or {}
        lines.append(
            f"target     python {target.get('python')}, {target.get('implementation')}, "
            f"{', '.join(target.get('platforms') or [])}"
        )
        rows: list[tuple[str, ...]] = [
            ("kind", "source", "repo", "requested", "revision", "files", "size", "licence", "remote code", "pickles")
        ]
        for it in self.items:
            rows.append(
                (
                    it["kind"],
                    it["source"],
                    it["repo_id"],
                    it["revision_requested"] or "-",
                    (it["revision"] or "-")[:12],
                    str(it["files"]),
                    format_bytes(it["bytes"]),
                    it["license"] or "UNKNOWN",
                    ", ".join(it["python_files"]) or "-",
                    _pickle_cell(it),
                )
            )
        lines += [""] + _table(rows)
        lines += [_media_line(it) for it in self.items if it.get("media")]
        if self.wheels:
            rows = [("wheel", "version", "licence", "size")]
            rows += [
                (
                    w["name"] + (f" [engine {w['engine']}]" if w.get("engine") else ""),
                    w["version"] or "-",
                    w["license"] or "UNKNOWN",
                    format_bytes(w["bytes"]),
                )
                for w in self.wheels
            ]
            lines += [""] + _table(rows)
        t = self.totals
        lines += [
            "",
            f"totals     {t['items']} item(s), {t['wheels']} wheel(s), {t['files']} files, {format_bytes(t['bytes'])}",
            f"read       {format_bytes(self.bytes_read)} of {format_bytes(self.bundle_bytes)} "
            f"({100 * self.bytes_read / max(self.bundle_bytes, 1):.3f} %)",
        ]
        delta = self.delta
        if delta is not None:
            lines += [
                "",
                f"delta      base {delta['base']}: carries {format_bytes(delta['carried_bytes'])}, "
                f"reuses {format_bytes(delta['reused_bytes'])} the isolated host already holds "
                f"(the full target is {format_bytes(delta['full_bytes'])})",
            ]
            rows = [("item", "files", "from base", "rebuilt by tensor", "carried", "reused")]
            rows += [
                (
                    r["label"],
                    str(r["files"]),
                    str(r["from_base"]),
                    str(r["rebuilt"]),
                    format_bytes(r["carried_bytes"]),
                    format_bytes(r["reused_bytes"]),
                )
                for r in delta["rows"]
            ]
            lines += _table(rows)
        lines += [f"note       {n}" for n in self.notes]
        return "\n".join(lines)

    def html(self) -> str:
        """One self-contained HTML page (inline CSS, no scripts, no external assets) for approvers: risk
        flags first, then the summary, the items and the wheels."""
        return render_html(self)


def inspect(bundle: str | Path, allowed_signers: str | Path | None = None) -> Inspection:
    """Read a bundle's metadata (directory, ``NAME.ferry.tar`` or its first volume) without its payload.

    ``allowed_signers``: an OpenSSH allowed_signers file; the signature is then checked against it (status
    ``verified`` or ``invalid``); without it a signature is only checked to be well formed (``unchecked``).

    Raises:
        BundleError: not a bundle, or one packed before metadata came first (use ``ferry verify``);
            a manifest that does not parse or is newer than this ferry.
    """
    bundle = Path(bundle)
    head = read_head(bundle)
    manifest = parse_manifest(head["manifest"])
    signature = _signature_status(head, manifest, Path(allowed_signers) if allowed_signers else None)
    notes: list[str] = []
    sbom = None
    if head["sbom"] is not None:
        entry = next((f for f in manifest.get("support_files", []) if f["path"] == SBOM_NAME), None)
        if entry is None or hashlib.sha256(head["sbom"]).hexdigest() != entry["sha256"]:
            notes.append(f"{SBOM_NAME} does not match its sha256 in manifest.json")
        else:
            sbom = json.loads(head["sbom"])
    else:
        notes.append(f"no {SBOM_NAME} in the bundle (packed by an older ferry): wheel licences unknown")
    items, wheels = _rows(manifest, sbom)
    inspection = Inspection(
        bundle=bundle,
        manifest=manifest,
        signature=signature,
        items=items,
        wheels=wheels,
        risks=[],
        bytes_read=head["bytes_read"],
        bundle_bytes=_bundle_size(bundle, notes),
        sbom_components=len((sbom or {}).get("components", [])),
        notes=notes,
    )
    inspection.risks = risk_flags(inspection)
    return inspection


def _bundle_size(bundle: Path, notes: list[str]) -> int:
    """The bundle's bytes (all volumes); only the given volume's when the others are not here (noted)."""
    try:
        return bundle_bytes(bundle)
    except BundleError:
        notes.append(f"only {bundle.name} is here: the size shown is that volume's")
        return bundle.stat().st_size


def signature_line(sig: dict[str, Any]) -> str:
    """One line describing the signature status."""
    status = sig["status"]
    if status == "verified":
        return f"VERIFIED: signed by {sig['principal']} ({sig['key']}), allowed by {sig['allowed_signers']}"
    if status == "unchecked":
        claimed = (sig.get("claimed") or {}).get("comment")
        return (
            f"signed by {sig['key']}"
            + (f" (claims to be {claimed})" if claimed else "")
            + "; not checked against pinned signers (pass --allowed-signers FILE)"
        )
    if status == "invalid":
        return f"INVALID: {sig['detail']}"
    if status == "unavailable":
        return f"present, not checked here: {sig['detail']}"
    return "UNSIGNED: no signature inside or beside the bundle"


def risk_flags(ins: Inspection) -> list[str]:
    """The risk flags, most serious first: signature, remote code, pickles carried, unknown licences, notes."""
    flags = []
    sig = ins.signature
    if sig["status"] == "unsigned":
        flags.append("unsigned bundle: a forged manifest and SHA256SUMS would still pass ferry verify")
    elif sig["status"] == "invalid":
        flags.append(f"invalid signature: {sig['detail']}")
    elif sig["status"] in ("unchecked", "unavailable"):
        flags.append("signature not checked against pinned signers (pass --allowed-signers FILE)")
    for it in ins.items:
        if it["trust_remote_code"]:
            flags.append(
                f"remote code: {it['repo_id']} ships {len(it['python_files'])} Python file(s) "
                f"({', '.join(it['python_files'])}) that trust_remote_code=True would run"
            )
    for it in ins.items:
        if it["pickles_carried"]:
            flags.append(
                f"pickle files: {it['repo_id']} carries {', '.join(it['pickles_carried'])} (loading them can run code)"
            )
    unknown = [it["repo_id"] for it in ins.items if _unknown(it["license"])]
    unknown += [f"{w['name']} {w['version']}" for w in ins.wheels if _unknown(w["license"])]
    if unknown:
        shown = ", ".join(unknown[:12]) + (f" and {len(unknown) - 12} more" if len(unknown) > 12 else "")
        flags.append(f"unknown licence: {shown}")
    flags += [n for n in ins.notes if "does not match" in n]
    return flags


def _unknown(licence: str | None) -> bool:
    return (licence or "").strip().lower() in UNKNOWN_LICENCES


def _signature_status(head: dict[str, Any], manifest: dict[str, Any], allowed: Path | None) -> dict[str, Any]:
    from bundler.signing import signature_key, verify_signature

    sig: dict[str, Any] = {
        "status": "unsigned",
        "principal": None,
        "key": None,
        "allowed_signers": None,
        "source": head["signature_source"],
        "claimed": manifest.get("signature"),
        "detail": None,
    }
    if head["signature"] is None:
        return sig
    try:
        if allowed is not None:
            try:
                sig.update(verify_signature(head["manifest"], head["signature"], allowed))
                sig["status"] = "verified"
            except IntegrityError as exc:
                problems = getattr(exc, "problems", None)
                sig.update(status="invalid", detail=problems[0] if problems else str(exc))
            return sig
        key = signature_key(head["manifest"], head["signature"])
        if key is None:
            sig.update(status="invalid", detail="the signature does not match manifest.json (altered after signing)")
        else:
            sig.update(status="unchecked", key=key)
    except BundleError as exc:  # ssh-keygen missing or too old
        sig.update(status="unavailable", detail=str(exc))
    return sig


def _carried_bytes(entry: dict[str, Any]) -> int:
    """Bytes a file's entry puts in the bundle: all of it, none (``from_base``) or its patch (``tensors``)."""
    mode = entry.get("delta", "carried")
    if mode == "from_base":
        return 0
    if mode == "tensors":
        return entry["patch"]["size"]
    return entry["size"]


def _media_line(item: dict[str, Any]) -> str:
    """The text line of a dataset item's images and videos (bundler/media.py)."""
    media = item["media"]
    videos = f", {media['videos']} video(s)" if media.get("videos") else ""
    return f"images     {item['repo_id']}: {media['images']} image(s){videos}, {format_bytes(media['bytes'])}"


def _pickle_cell(it: dict[str, Any]) -> str:
    parts = []
    if it["pickles_carried"]:
        parts.append("carried: " + ", ".join(it["pickles_carried"]))
    if it["pickles_skipped"]:
        parts.append("skipped: " + ", ".join(it["pickles_skipped"]))
    return "; ".join(parts) or "-"


def _rows(manifest: dict[str, Any], sbom: dict[str, Any] | None) -> tuple[list[dict], list[dict]]:
    by_ref = {c.get("bom-ref"): c for c in (sbom or {}).get("components", [])}
    items, wheels = [], []
    for item in manifest["items"]:
        files = item["files"]
        if item["kind"] == "wheels":
            for f in files:
                if not f["path"].endswith(".whl"):
                    continue
                comp = by_ref.get(f"wheel:{f['path']}") or {}
                engine, _, name = f["path"].removeprefix("engines/").rpartition("/")  # a serving engine's own
                parts = name[:-4].split("-")
                wheels.append(
                    {
                        "file": f["path"],
                        "name": comp.get("name") or parts[0],
                        "version": comp.get("version") or (parts[1] if len(parts) > 1 else None),
                        "license": _sbom_licence(comp),
                        "files": 1,
                        "bytes": f["size"],
                        "sha256": f["sha256"],
                        "engine": engine if f["path"].startswith("engines/") else None,
                    }
                )
            continue
        carried = [f["path"] for f in files if posixpath.splitext(f["path"])[1].lower() in PICKLE_SUFFIXES]
        items.append(
            {
                "kind": item["kind"],
                "source": item["source"],
                "spec": item.get("spec"),
                "repo_id": item.get("repo_id") or item["path"],
                "revision_requested": item.get("revision_requested"),
                "revision": item.get("revision"),
                "path": item["path"],
                "files": len(files),
                "bytes": sum(f["size"] for f in files),
                "license": item.get("license"),
                "trust_remote_code": bool(item.get("trust_remote_code")),
                "python_files": list(item.get("python_files") or []),
                "pickles_carried": carried,
                "pickles_skipped": list(item.get("skipped_files") or []),
                "media": item.get("media"),
            }
        )
    return items, wheels


def _sbom_licence(component: dict[str, Any]) -> str | None:
    names = []
    for entry in component.get("licenses", []):
        if "expression" in entry:
            names.append(entry["expression"])
        else:
            lic = entry.get("license", {})
            names.append(lic.get("id") or lic.get("name"))
    names = [n for n in names if n]
    return " AND ".join(names) if names else None


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


# ---------------------------------------------------------------------------------------------------------
# HTML (one self-contained page: inline CSS, no scripts, no external assets).
# ---------------------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:24px;color:#1b1f23}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:22px 0 8px;border-bottom:1px solid #d0d7de}
.sub{color:#57606a;margin-bottom:14px}
.risks{border:2px solid #cf222e;background:#ffebe9;border-radius:6px;padding:10px 14px}
.risks.ok{border-color:#1a7f37;background:#dafbe1}
.risks li{margin:3px 0}
.sig{padding:8px 12px;border-radius:6px;background:#f6f8fa;border:1px solid #d0d7de}
.sig.verified{background:#dafbe1;border-color:#1a7f37}
.sig.invalid,.sig.unsigned{background:#ffebe9;border-color:#cf222e}
table{border-collapse:collapse;width:100%;margin:4px 0 8px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;white-space:nowrap}
.flag{color:#cf222e;font-weight:600}code{font:12px ui-monospace,"DejaVu Sans Mono",monospace}
td.rev code{word-break:break-all}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:0}dt{color:#57606a}dd{margin:0}
"""


def render_html(ins: Inspection) -> str:
    """The approvers' page of :meth:`Inspection.html`."""
    e = html.escape
    m, sig, delta = ins.manifest, ins.signature, ins.delta
    notes = "".join(f"<li>{e(n)}</li>" for n in ins.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>ferry bundle {e(m["name"])}</title><style>{_CSS}</style></head>
<body>
<h1>ferry bundle <code>{e(m["name"])}</code></h1>
<div class="sub">id {e(m["bundle_id"])} &middot; packed {e(str(m.get("created")))} &middot;
{e(str(ins.bundle.name))}</div>
{_html_risks(ins.risks)}
<h2>Signature</h2>
<div class="sig {e(sig["status"])}">{e(signature_line(sig))}</div>
<h2>Summary</h2>
{_html_dl(_html_summary(ins, delta))}
<h2>Provenance</h2>
{_html_dl(_html_provenance(m))}
<h2>Models and datasets</h2>
<table><tr><th>kind</th><th>source</th><th>repo</th><th>requested</th><th>revision</th><th>files</th><th>size</th>
<th>licence</th><th>remote code (.py)</th><th>pickle files</th></tr>{_html_item_rows(ins.items)}</table>
<h2>Wheels</h2>
{_html_wheels(ins.wheels)}
{_html_delta(delta) if delta is not None else ""}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body></html>
"""


def _html_risks(risks: list[str]) -> str:
    """The risk box: every flag, or a green "No risk flags"."""
    items = "".join(f"<li>{html.escape(r)}</li>" for r in risks)
    return (
        f'<div class="risks"><strong>Risk flags ({len(risks)})</strong><ul>{items}</ul></div>'
        if risks
        else '<div class="risks ok"><strong>No risk flags</strong></div>'
    )


def _html_dl(values: dict[str, Any]) -> str:
    """A definition list of ``values``, leaving out the empty ones (None or ``""``)."""
    e = html.escape
    return (
        "<dl>"
        + "".join(f"<dt>{e(k)}</dt><dd>{e(str(v))}</dd>" for k, v in values.items() if v not in (None, ""))
        + "</dl>"
    )


def _html_summary(ins: Inspection, delta: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's rows: bundle, id, format, target, totals (bytes shown human-readable), bytes read to inspect,
    and for a delta bundle its base and the bytes carried and reused."""
    m, t = ins.manifest, ins.totals
    target = m.get("target") or {}
    summary = {
        "bundle": m["name"],
        "bundle id": m["bundle_id"],
        "format version": m.get("format_version"),
        "target python": f"{target.get('python')} ({target.get('implementation')})",
        "target platforms": ", ".join(target.get("platforms") or []),
        "totals": f"{t['items']} item(s), {t['wheels']} wheel(s), {t['files']} files, {format_bytes(t['bytes'])}",
        "read to inspect": f"{format_bytes(ins.bytes_read)} of {format_bytes(ins.bundle_bytes)}",
    }
    if delta is not None:
        summary["delta base"] = delta["base"]
        summary["carried"] = f"{format_bytes(delta['carried_bytes'])} of {format_bytes(delta['full_bytes'])}"
        summary["reused from the base"] = format_bytes(delta["reused_bytes"])
    return summary


def _html_provenance(m: dict[str, Any]) -> dict[str, Any]:
    """The provenance rows of manifest ``m`` (older manifests: the packing host from ``host``)."""
    return {
        "ferry version": m.get("ferry_version"),
        "packed": m.get("created"),
        "packing host python": (m.get("provenance") or {}).get("python") or (m.get("host") or {}).get("python"),
        "packing host platform": (m.get("provenance") or {}).get("platform") or (m.get("host") or {}).get("platform"),
        "packing host": (m.get("provenance") or {}).get("hostname"),
        "Hugging Face endpoint": (m.get("provenance") or {}).get("hf_endpoint"),
        "ModelScope endpoint": (m.get("provenance") or {}).get("ms_endpoint"),
        "pip indexes": ", ".join((m.get("provenance") or {}).get("pip_index_urls") or []) or None,
    }


def _html_item_rows(items: list[dict[str, Any]]) -> str:
    """One table row per model or dataset, unknown licences, remote code and carried pickles flagged."""
    e = html.escape
    return "".join(
        "<tr>"
        + "".join(
            [
                f"<td>{e(it['kind'])}</td>",
                f"<td>{e(it['source'])}</td>",
                f"<td><code>{e(it['repo_id'])}</code></td>",
                f"<td>{e(str(it['revision_requested'] or '-'))}</td>",
                f"<td class=rev><code>{e(str(it['revision'] or '-'))}</code></td>",
                f"<td class=num>{it['files']}</td>",
                f"<td class=num>{e(format_bytes(it['bytes']))}</td>",
                f"<td{' class=flag' if _unknown(it['license']) else ''}>{e(it['license'] or 'unknown')}</td>",
                f"<td{' class=flag' if it['trust_remote_code'] else ''}>"
                f"{e(', '.join(it['python_files'])) if it['trust_remote_code'] else 'no'}</td>",
                f"<td{' class=flag' if it['pickles_carried'] else ''}>{e(_pickle_cell(it))}</td>",
            ]
        )
        + "</tr>"
        for it in items
    )


def _html_wheels(wheels: list[dict[str, Any]]) -> str:
    """The wheels table (name, version, licence, size, sha256 prefix), or "No wheels."."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(w['name'])}</td><td>{e(str(w['version'] or '-'))}</td>"
        f"<td{' class=flag' if _unknown(w['license']) else ''}>{e(w['license'] or 'unknown')}</td>"
        f"<td class=num>{e(format_bytes(w['bytes']))}</td><td><code>{e(w['sha256'][:16])}…</code></td></tr>"
        for w in wheels
    )
    return (
        f"<table><tr><th>wheel</th><th>version</th><th>licence</th><th>size</th><th>sha256</th></tr>{rows}</table>"
        if wheels
        else "<p>No wheels.</p>"
    )


def _html_delta(delta: dict[str, Any]) -> str:
    """The delta section: the base, and per item the files from the base, rebuilt, and the bytes carried and
    reused."""
    e = html.escape
    rows = "".join(
        f"<tr><td><code>{e(r['label'])}</code></td><td class=num>{r['files']}</td>"
        f"<td class=num>{r['from_base']}</td><td class=num>{r['rebuilt']}</td>"
        f"<td class=num>{e(format_bytes(r['carried_bytes']))}</td>"
        f"<td class=num>{e(format_bytes(r['reused_bytes']))}</td></tr>"
        for r in delta["rows"]
    )
    return (
        f"<h2>Delta</h2><p>Packed against base <code>{e(delta['base'])}</code> (sha256 of the base "
        f"document): the isolated host must already hold every file marked from base; the install checks "
        f"each before writing anything.</p><table><tr><th>item</th><th>files</th><th>from base</th>"
        f"<th>rebuilt by tensor</th><th>carried</th><th>reused</th></tr>{rows}</table>"
    )


def write_html(ins: Inspection, path: str | Path) -> Path:
    """Write :meth:`Inspection.html` to ``path`` atomically; return the path."""
    path = Path(path)
    atomic_write_text(path, ins.html())
    return path
