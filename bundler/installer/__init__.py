"""The stand-alone installer: small modules, standard library only, joined into every bundle's ``install.py``.

A bundle must verify and install on a host that has nothing but ``python3`` (>= 3.10). These modules import only
the standard library, each other, and the modules of ferry's foundation that do the same (:mod:`ferry.errors`,
:mod:`ferry.constants`, :mod:`ferry.fsutil`, :mod:`ferry.serving_tools`, :mod:`bundler.format`): nothing is
copied. ``ferry verify`` / ``ferry install`` / ``ferry state`` / ``ferry inspect`` import them directly (with
progress bars); :mod:`bundler.installer.generate` joins them, in import order, into the one plain-text
``install.py`` that ``ferry pack`` writes into every bundle (as pip's ``get-pip.py`` is generated, not written)::

    python -m bundler.installer.generate            # rewrite the committed copy, bundler/installer/install.py.generated
    python -m bundler.installer.generate --check    # exit 1 when the committed copy is not a fresh generation

The modules, each importing only those above it::

    report       one line to stderr, an IntegrityError listing every problem, progress in percent
    hashing      read once, hash (and write) in a background thread; (size, sha256) of a file
    fields       one untrusted manifest field each: bundle paths, repo ids, revisions
    manifest     manifest.json: parse, validate (delta fields too), the files it vouches for, identities
    scan         what one pass saw, compared with the manifest and SHA256SUMS; bundle directories
    archive      NAME.ferry.tar and its volumes as one forward-only stream
    fs           permission bits, atomic text and links, temp folders, paths inside the prefix; the prefix lock
    signature    ssh-keygen signatures, the metadata head, the prefix's signer policy
    check        one pass over a bundle, checked against its manifest and signature
    records      PREFIX/.ferry/state.json and PREFIX/ferry.env
    place        the Hugging Face cache, whole folders (through a journal), the wheel store
    datasets     dataset folders, LLaMA-Factory's dataset_info.json, hub datasets
    modelscope   ModelScope folders and the hook that keeps its SDK offline
    venv         the bundle's venv: fits this host? build it from the wheels alone, check it against RECORD
    safetensors  tensors' byte ranges and digests
    prefix       an installed prefix read back: drift, items, the state document
    delta        a delta bundle completed from what the prefix holds
    plan         where each item goes, proven to lie inside the prefix
    install      install_bundle: stage, check, place (the module that draws the installed prefix)
    main         the command line of install.py
"""
