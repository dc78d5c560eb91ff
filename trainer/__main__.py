"""``python -m trainer CONFIG.yaml [KEY=VALUE ...]``: one training worker.

What ``ferry train`` runs under torchrun; also for users who launch torchrun themselves (Slurm, Kubernetes)::

    torchrun --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 \\
        -m trainer config.yaml learning_rate=1e-4

Without torchrun's environment it trains in this one process (world size 1). A
:class:`ferry.errors.FerryError` prints one line (``ferry: error: ...``) and exits with the error's code;
torchrun then restarts the group (``--max-restarts``) or reports the failure.
"""

from __future__ import annotations

import os
import sys

from ferry.constants import apply_offline_env

apply_offline_env()  # before torch / transformers are imported

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from ferry.errors import FerryError  # noqa: E402

USAGE = "usage: python -m trainer CONFIG.yaml [KEY=VALUE ...]   (or: torchrun [OPTIONS] -m trainer CONFIG.yaml ...)"


@record
def main(argv: list[str] | None = None) -> int:
    """Load the config (file + overrides), train, print rank 0's report path. Returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    from trainer.config import load_config
    from trainer.launch import wait_at_launch_gate
    from trainer.stages import train

    rank = os.environ.get("RANK", "0")
    try:
        cfg = load_config(args[0], args[1:])
        from pathlib import Path

        from ferry.output import route_library_output  # the libraries' output to output_dir/logs/

        route_library_output(Path(cfg.output_dir) / "logs" / f"libraries-rank{rank}.log")
        # Import the heavy libraries while `ferry train` is still tokenising, then wait for its verdict; without
        # quantization_bit, not bitsandbytes (a second of torch._inductor imports that peft would pull in).
        from trainer.quant_keys import keep_bitsandbytes_out

        keep_bitsandbytes_out(cfg)
        import peft  # noqa: F401
        import transformers.modeling_utils  # noqa: F401

        if not wait_at_launch_gate():
            return 0  # the launcher failed validation and reports it; nothing to add
        report = train(cfg) if cfg.do_train else None
        if cfg.do_predict:  # trainer/predict.py: the trained adapter unless adapter_name_or_path names one
            from trainer.predict import predict

            given = list(cfg.adapter_name_or_path or [])  # the model this run starts from
            tuned = given
            if report is not None:  # the trained adapter over what training merged into the base
                tuned = (given if cfg.create_new_adapter else given[:-1]) + [report.adapter_dir]
                if cfg.do_eval:  # before vs after, side by side in the run summary
                    predict(cfg, adapters=given, output_dir=os.path.join(cfg.output_dir, "base"))
            prediction = predict(cfg, adapters=tuned)
            if rank == "0":
                print(
                    f"ferry: predictions of {prediction.num_rows} rows in {prediction.predictions_path}; "
                    f"{prediction.metrics}",
                    file=sys.stderr,
                )
    except FerryError as exc:
        where = f"[rank {rank}] " if "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1" else ""
        print(f"ferry: error: {where}{exc}", file=sys.stderr)
        return exc.exit_code
    if rank == "0" and report is not None:
        print(report.summary_line(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        sys.exit(main())
    # Under torchrun: once main returns (or raises, after ``record`` wrote torchrun's error file) every output is
    # written and synchronised, so skip the process group's teardown (``DistEnv.destroy``) and the interpreter's
    # finalisation, where a group whose peer has already exited can block this rank (and torchrun) forever;
    # the OS closes the sockets.
    try:
        code = main()
        if code is None:  # record() returns None where main raised SystemExit(0)
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - the traceback goes to stderr as Python would print it
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
