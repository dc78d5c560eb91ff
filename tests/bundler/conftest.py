"""Fixtures of the bundler tests: a real olah hub serving the stories260K model and an alpaca dataset.

``hub`` (session scope) is a :class:`tests.support.hub.Hub` with

* ``stories/stories260K`` (model): the files of ``../shared/assets/models/stories260K`` plus a model card
  ``README.md`` whose front matter says ``license: mit``; ``model.safetensors`` is an LFS file; tag ``v1``.
* ``llamafactory/alpaca_en_demo`` (dataset): ``alpaca_en_demo.json`` from the LLaMA-Factory demo data.

``hub_env`` points ``$HF_ENDPOINT`` at it for the test (ferry reads it at call time) and gives the test its
own ``$HF_HOME``. Tests that need more repos add them with ``hub.add_model(...)`` under a unique repo id.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.helpers import ALPACA_REPO, MODEL_CARD, STORIES_REPO, set_online_env
from tests.support.hub import Hub, serve_hub


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> Iterator[Hub]:
    """A running olah hub holding the stories260K model and the alpaca_en_demo dataset (see module doc)."""
    root = tmp_path_factory.mktemp("hub")
    with serve_hub(root) as server:
        files: dict[str, Path | str] = {p.name: p for p in sorted(stories_model.iterdir()) if p.is_file()}
        files["README.md"] = MODEL_CARD
        server.add_model(STORIES_REPO, files, tag="v1")
        server.add_dataset(ALPACA_REPO, {"alpaca_en_demo.json": llamafactory_data / "alpaca_en_demo.json"})
        yield server


@pytest.fixture()
def hub_env(hub: Hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Hub:
    """``hub`` with ``$HF_ENDPOINT`` (and a private ``$HF_HOME``, no token) set for this test."""
    set_online_env(monkeypatch, hub, tmp_path / "hf-home")
    return hub


REMOTE_REPO = "acme/remote-code"


@pytest.fixture(scope="session")
def review_bundle(hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A bundle an approver would review (tests of inspect and the SBOM), packed once, signed by alice:

    ``stories/stories260K@v1`` (hf, licence mit), ``acme/remote-code`` (hf, a ``modeling_acme.py`` and a
    pickle ``acme_weights.pt`` carried with allow_pickle, licence ``other``), the hf dataset
    ``llamafactory/alpaca_en_demo``, and the wheels six and idna from PyPI. Returns ``{"out", "dir", "tar",
    "key", "allowed", "result"}``.
    """
    import subprocess

    from bundler.pack import pack
    from bundler.spec import load_spec

    root = tmp_path_factory.mktemp("review")
    hub.add_model(
        REMOTE_REPO,
        {
            "config.json": '{"model_type": "acme", "auto_map": {"AutoModel": "modeling_acme.AcmeModel"}}\n',
            "modeling_acme.py": "import torch\n\nclass AcmeModel(torch.nn.Module):\n    pass\n",
            "acme_weights.pt": b"\x80\x02}q\x00." + bytes(4096),
            "README.md": "---\nlicense: other\n---\n# acme\n",
        },
    )
    key = root / "alice"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice@bank.example", "-f", str(key)], check=True
    )
    allowed = root / "allowed_signers"
    allowed.write_text(f'alice@bank.example namespaces="ferry-bundle" {(root / "alice.pub").read_text().strip()}\n')
    with pytest.MonkeyPatch.context() as mp:
        set_online_env(mp, hub, root / "hf-home")
        spec = load_spec(
            name="review",
            models=[f"hf:{STORIES_REPO}@v1", f"hf:{REMOTE_REPO}"],
            datasets=[f"hf:{ALPACA_REPO}"],
            allow_pickle=True,
        )
        spec.wheels.requirements = ["six==1.17.0", "idna==3.10"]
        result = pack(spec, root / "out", progress=False, sign=key)
    return {
        "out": root / "out",
        "dir": root / "out" / "review",
        "tar": root / "out" / "review.ferry.tar",
        "key": key,
        "allowed": allowed,
        "result": result,
    }
