"""``ferry train --accelerate-config FILE``: the distributed settings of an accelerate config file, as ferry's keys.

LLaMA-Factory starts some examples with ``accelerate launch --config_file FILE train.py EXAMPLE.yaml`` (its
``examples/extras/fsdp_qlora/train.sh`` names ``examples/accelerate/fsdp_config.yaml``): the FSDP settings live
in that file, not in the example's YAML. :func:`read_accelerate_config` maps what the file says onto ferry's own
keys and launch options, as ``deepspeed: FILE`` is mapped (``trainer/lf_compat.py``), with one logged line:

- ``distributed_type: FSDP`` -> ``fsdp``: ``fsdp_config.fsdp_sharding_strategy`` FULL_SHARD / SHARD_GRAD_OP /
  HYBRID_SHARD / HYBRID_SHARD_ZERO2 (or accelerate's numbers 1, 2, 4, 5) -> ``full_shard`` / ``shard_grad_op`` /
  ``hybrid_shard`` / ``hybrid_shard_zero2``; NO_SHARD (3) -> DDP. FSDP2 files (``fsdp_version: 2``) carry
  ``fsdp_reshard_after_forward`` instead: true -> ``full_shard``, false -> ``shard_grad_op``.
  ``fsdp_offload_params: true`` adds ``offload``; ``fsdp_activation_checkpointing`` sets
  ``fsdp_config.activation_checkpointing``. The wrap policy, state-dict type, prefetch, ``use_orig_params``,
  ``sync_module_states`` and ``cpu_ram_efficient_loading`` have no ferry key: ferry always wraps each decoder
  layer and loads each rank's shards only.
- ``distributed_type: DEEPSPEED`` -> ``deepspeed_config.zero_stage`` and ``offload_*_device`` as ``deepspeed:``
  (ZeRO 3 -> full_shard, 2 -> shard_grad_op, 0/1 -> DDP, a cpu offload adds ``offload``).
- ``MULTI_GPU``, ``MULTI_CPU``, ``NO`` -> DDP.
- ``num_processes`` (all machines together) / ``num_machines`` -> ``--nproc-per-node``, ``num_machines`` ->
  ``--nnodes``, ``machine_rank`` / ``main_process_ip`` / ``main_process_port`` -> ``--node-rank`` /
  ``--master-addr`` / ``--master-port``, each only where the command line left the option unset.
- ``mixed_precision`` is not read: the YAML's ``bf16`` / ``fp16`` decide, as transformers' TrainingArguments
  override accelerate's ``mixed_precision`` in LLaMA-Factory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError
from trainer.lf_compat import zero_fsdp_options

_log = logging.getLogger("ferry.trainer.config")

#: accelerate's FSDP sharding strategy (its names, or the numbers of torch's ShardingStrategy enum + 1 that
#: older accelerate files hold) -> ferry's fsdp option; None = no sharding (DDP).
SHARDING = {
    "FULL_SHARD": "full_shard",
    "SHARD_GRAD_OP": "shard_grad_op",
    "NO_SHARD": None,
    "HYBRID_SHARD": "hybrid_shard",
    "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
    1: "full_shard",
    2: "shard_grad_op",
    3: None,
    4: "hybrid_shard",
    5: "hybrid_shard_zero2",
}
_DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "NO")


@dataclass
class AccelerateLaunch:
    """What an accelerate config file sets: ``keys`` (ferry config keys: ``fsdp``, ``fsdp_config``) and the
    launch options (None = the file does not say), plus the one line :func:`read_accelerate_config` logs."""

    path: str
    keys: dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    note: str = ""


def _int(data: dict[str, Any], key: str, where: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: {key}: expected a non-negative integer, got {value!r}")
    return value


def read_accelerate_config(path: str | os.PathLike[str]) -> AccelerateLaunch:
    """The ferry keys and launch options of accelerate config file ``path`` (see the module docstring).

    Raises:
        ConfigError: one line naming the file and key: the file is missing or not a YAML mapping; a
            ``distributed_type`` ferry does not run (TPU, XLA, Megatron-LM, ...); an unknown sharding strategy;
            ZeRO-Infinity NVMe offload; ``num_processes`` not a multiple of ``num_machines``.
    """
    import yaml

    file = Path(path)
    where = str(file)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"accelerate config {where!r} does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"accelerate config {where!r} is not a YAML file: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"accelerate config {where!r}: expected a mapping of KEY: VALUE")
    kind = str(data.get("distributed_type") or "NO").upper()
    keys: dict[str, Any] = {}
    if kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        if not isinstance(fsdp, dict):
            raise ConfigError(f"{where}: fsdp_config: expected a mapping")
        if "fsdp_sharding_strategy" in fsdp:
            raw = fsdp["fsdp_sharding_strategy"]
            strategy_key = raw.upper() if isinstance(raw, str) else raw
            if strategy_key not in SHARDING:
                raise ConfigError(
                    f"{where}: fsdp_config.fsdp_sharding_strategy: {raw!r} is not one of "
                    f"{', '.join(k for k in SHARDING if isinstance(k, str))}"
                )
            strategy = SHARDING[strategy_key]
        else:  # FSDP2 files: reshard after forward or keep the gathered weights until the backward (ZeRO-2)
            strategy = "full_shard" if fsdp.get("fsdp_reshard_after_forward", True) else "shard_grad_op"
        options = [strategy] if strategy else []
        if options and fsdp.get("fsdp_offload_params"):
            options.append("offload")
        keys["fsdp"] = options
        if options and fsdp.get("fsdp_activation_checkpointing") is not None:
            keys["fsdp_config"] = {"activation_checkpointing": bool(fsdp["fsdp_activation_checkpointing"])}
    elif kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        stage = ds.get("zero_stage", 0) if isinstance(ds, dict) else 0
        devices = (
            {str(ds.get(k, "none")).lower() for k in ("offload_param_device", "offload_optimizer_device")}
            if isinstance(ds, dict)
            else {"none"}
        )
        keys["fsdp"] = zero_fsdp_options(stage, devices, f"{where}: deepspeed_config (zero_stage, offload_*_device)")
    elif kind in _DDP_TYPES:
        keys["fsdp"] = []
    else:
        raise ConfigError(
            f"{where}: distributed_type: {kind} is not run by ferry (it trains with DDP or FSDP2 "
            f"under torchrun: FSDP, DEEPSPEED, MULTI_GPU, MULTI_CPU or NO)"
        )

    launch = AccelerateLaunch(path=where, keys=keys)
    machines = _int(data, "num_machines", where) or 1
    processes = _int(data, "num_processes", where)
    if processes:
        if processes % machines:
            raise ConfigError(f"{where}: num_processes: {processes} is not a multiple of num_machines: {machines}")
        launch.nproc_per_node = processes // machines
    launch.nnodes = machines
    if machines > 1:
        launch.node_rank = _int(data, "machine_rank", where)
        launch.master_addr = str(data["main_process_ip"]) if data.get("main_process_ip") else None
        launch.master_port = _int(data, "main_process_port", where)
    what = f"fsdp: {' '.join(keys['fsdp'])}" if keys["fsdp"] else "DDP (no fsdp)"
    procs = f", {launch.nproc_per_node} process(es) per node on {machines} node(s)" if processes else ""
    launch.note = f"--accelerate-config {file.name} (distributed_type {kind}{procs}) runs as {what}"
    return launch


def apply_accelerate_keys(
    data: MutableMapping[str, Any], origin: MutableMapping[str, str], launch: AccelerateLaunch
) -> None:
    """Put the file's keys into a config's raw ``data`` (before the command line's KEY=VALUE overrides), each
    with ``origin`` the file; logs the note.

    Raises:
        ConfigError: the YAML already chooses its parallelism (``fsdp`` or ``deepspeed``) and the file would
            change it: one line naming both.
    """
    for key in ("fsdp", "deepspeed"):
        if data.get(key) not in (None, False, "", []):
            raise ConfigError(
                f"{origin.get(key, 'config')}: {key} is set and --accelerate-config {launch.path} "
                f"sets the parallelism too; keep one"
            )
    for key, value in launch.keys.items():
        if key == "fsdp_config" and isinstance(data.get(key), dict):
            value = {**data[key], **value}
        data[key] = value
        origin[key] = launch.path
    _log.warning("%s", launch.note)


__all__ = ["SHARDING", "AccelerateLaunch", "apply_accelerate_keys", "read_accelerate_config"]
