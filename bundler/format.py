"""The ferry bundle format, versions 1 (full bundles) and 2 (delta bundles). Standard library only (the bundle's
stand-alone ``install.py`` is generated with this module in it: bundler/installer/generate.py).

A bundle is a directory, and the same directory as one uncompressed POSIX tar (weights do not compress)::

    OUT/
    ├── NAME/                              the bundle directory
    │   ├── models/
    │   │   ├── hf/ORG/NAME/...            a Hugging Face snapshot, files as in the repo at the resolved commit
    │   │   ├── ms/ORG/NAME/...            a ModelScope snapshot
    │   │   └── local/NAME/...             a local folder
    │   ├── datasets/
    │   │   ├── hf/ORG/NAME/...            a Hugging Face dataset repo snapshot, plus
    │   │   │   └── .ferry-datasets-cache/ORG___name/CONFIG/0.0.0/COMMIT/   its `datasets` Arrow cache
    │   │   ├── local/NAME/...             a local file or folder
    │   │   └── nltk/SUBDIR/ID/...         an NLTK data package, unzipped (bundler/nltk_data.py)
    │   ├── wheels/
    │   │   ├── *.whl                      every wheel the target host needs (pip download)
    │   │   └── requirements.lock          one line per wheel: NAME==VERSION --hash=sha256:HEX
    │   ├── install.py                     stand-alone installer (standard library only)
    │   ├── manifest.json                  see below
    │   ├── manifest.json.sig              with --sign KEY: `ssh-keygen -Y sign -n ferry-bundle` over manifest.json
    │   ├── sbom.cdx.json                  CycloneDX 1.6 SBOM: wheels, models, datasets, each file's sha256
    │   └── SHA256SUMS                     coreutils format over every file but itself: `sha256sum -c SHA256SUMS`
    ├── NAME.ferry.tar                     members NAME/..., METADATA FIRST:
    │                                        manifest.json, [manifest.json.sig], sbom.cdx.json,
    │                                        one pax global header (filler of the reserved head, extracts nothing),
    │                                        content, install.py, SHA256SUMS last
    │   or, with --split-size: NAME.ferry.tar.000 (the metadata head alone, ~100 kB), .001, ...  (a byte
    │                                      split of that tar stream, `cat NAME.ferry.tar.* | tar x` works)
    ├── NAME.ferry.sig                     with --sign: the same signature, beside the bundle
    └── NAME.ferry.sha256                  with volumes only: coreutils format over them (`sha256sum -c`
                                           names a damaged volume); a single tar needs none, the manifest
                                           inside it covers every byte of content

Metadata first: ``ferry inspect`` (and the signature pre-check of ``ferry verify``) reads the archive's
head only: about 100 kB plus about 1 kB per file, whatever the bundle's size. The writer reserves the head
before the one pass from an upper bound of the three members and fills it at the end (:mod:`bundler.writer`);
the members are exact files, the slack is the filler header.

``manifest.json`` (``format_version`` 1)::

    {
      "format_version": 1,
      "name": "NAME", "bundle_id": "<uuid4 hex>", "created": "2026-11-21T19:50:00Z",
      "ferry_version": "0.1.0",
      "host":   {"python": "3.11", "platform": "linux_x86_64", "implementation": "cp"},
      "target": {"python": "3.11", "platforms": ["manylinux_2_28_x86_64", ...], "implementation": "cp"},
      "provenance": {"hf_endpoint": "https://huggingface.co", "ms_endpoint": "...", "pip_index_urls": [...],
                     "hostname": "packer-01", "python": "3.11.9", "platform": "Linux-6.1-x86_64-with-glibc2.36"},
      "signature": {"namespace": "ferry-bundle", "key": "ED25519 key SHA256:...", "comment": "alice@bank"},
                                                 # with --sign only: who claims to sign (checked by allowed_signers)
      "support_files": [{"path": "install.py", ...}, {"path": "sbom.cdx.json", "size": 123, "sha256": "..."}],
      "items": [
        {
          "kind": "model" | "dataset" | "wheels",
          "source": "hf" | "ms" | "local" | "nltk" (datasets) | "uv" (wheels; "pip" in older bundles),
          "spec": "hf:ORG/NAME@main",            # what the user asked for
          "repo_id": "ORG/NAME",                 # local sources: "local/NAME"
          "revision_requested": "main" | null,
          "revision": "<40-hex commit>",         # local sources: sha1 over the sorted (path, sha256) list;
                                                 # nltk: the sha256 of the package's zip
          "license": "apache-2.0" | null,        # from the model card's front matter when it states one
          "trust_remote_code": false,            # true when the repo holds *.py files
          "python_files": ["modeling_x.py"],
          "skipped_files": ["pytorch_model.bin"],  # pickle files left out (safetensors beside them)
          "path": "models/hf/ORG/NAME",          # the item's folder inside the bundle
          "files": [{"path": "config.json", "size": 1234, "sha256": "..."}]   # relative to "path"
        }
      ]
    }

Every byte of the bundle except ``manifest.json``, ``manifest.json.sig`` and ``SHA256SUMS`` is covered by a
sha256 in the manifest; ``SHA256SUMS`` (which also lists ``manifest.json``) is a convenience for
``sha256sum -c``. A manifest brought
over a separate channel (``ferry verify --manifest``) therefore vouches for every byte.

Delta bundles (``format_version`` 2, ``ferry pack --base``; bundler/delta.py) carry only what the isolated
host lacks. The manifest still lists the full target, every file as in a full bundle, plus::

      "base": "<sha256 of the base document>",   # a `ferry state` document, or an earlier manifest.json
      ... each file of each item:
      {"path": "config.json", "size": 1234, "sha256": "...", "delta": "carried"}      # in the bundle, as before
      {"path": "tokenizer.json", "size": ..., "sha256": "...", "delta": "from_base"}  # the host holds it
      {"path": "model.safetensors", "size": ..., "sha256": "...", "delta": "tensors",  # rebuilt on the host
       "patch": {"size": P, "sha256": "...", "base_sha256": "...", "base_size": B,
                 "segments": [["patch", 0, 1024], ["base", 1024, 4096], ...]}}

A ``tensors`` file travels as ``deltas/ITEM_PATH/FILE_PATH``: the new safetensors header and the tensors that
changed (``P`` bytes); the segments, in file order, take bytes from that member (``patch``) or from the installed
file whose sha256 is ``base_sha256`` (``base``). The install keeps every wheel and lock file as
``PREFIX/wheels/<sha256>`` so that later deltas can leave unchanged wheels behind. The state document::

    {"format": "ferry-state", "version": 1, "trust_recorded": false,
     "items": [{"kind", "source", "repo_id", "revision", "revision_requested",
                "files": [{"path", "size", "sha256", "tensors": {NAME: [start, end, sha256]}}]}],
     "wheels": [{"path", "size", "sha256"}]}

Readers refuse a ``format_version`` newer than :data:`FORMAT_VERSION` with a message telling the user to
upgrade ferry, and read older ones. Full bundles are still written as version 1
(:data:`FULL_FORMAT_VERSION`), so an older ferry installs them.
"""

from __future__ import annotations

FORMAT_VERSION = 2
#: What full bundles are written as (they use nothing of version 2).
FULL_FORMAT_VERSION = 1
#: Folder of a delta bundle holding the carried tensors of safetensors files rebuilt on the host.
DELTAS_DIRNAME = "deltas"
#: PREFIX/wheels/<sha256>: every wheel and lock file an install kept (what a delta's unchanged wheels come from).
WHEEL_STORE_DIRNAME = "wheels"
#: The ``format`` of a ``ferry state`` document.
STATE_FORMAT = "ferry-state"
MANIFEST_NAME = "manifest.json"
SUMS_NAME = "SHA256SUMS"
INSTALLER_NAME = "install.py"
LOCK_NAME = "requirements.lock"
ARCHIVE_SUFFIX = ".ferry.tar"
VOLUMES_SUMS_SUFFIX = ".ferry.sha256"
VOLUME_DIGITS = 3
SIGNATURE_NAME = "manifest.json.sig"
SIGNATURE_SUFFIX = ".ferry.sig"
SIGNATURE_NAMESPACE = "ferry-bundle"
SBOM_NAME = "sbom.cdx.json"
#: Folder inside a Hugging Face dataset item that holds the ``datasets`` library's Arrow cache of the repo
#: (``ORG___name/CONFIG/0.0.0/COMMIT/``), built by ``ferry pack``: offline, ``datasets.load_dataset("ORG/NAME")``
#: reads hub datasets from that cache only (bundler/hub_datasets.py).
DATASETS_CACHE_DIRNAME = ".ferry-datasets-cache"
#: PREFIX/nltk_data/SUBDIR/ID: NLTK data packages (``source: nltk`` items); ferry.env's ``NLTK_DATA`` names it.
NLTK_DATA_DIRNAME = "nltk_data"
#: The prefix's signer policy: PREFIX/.ferry/allowed_signers.
POLICY_NAME = "allowed_signers"

#: Weight files that unpickle arbitrary code when loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")
