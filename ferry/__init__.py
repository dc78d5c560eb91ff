"""ferry: carry LLM fine-tuning across an air gap.

The ``ferry`` package is the foundation every other package stands on: ``errors`` (the typed error family),
``constants`` (environment variables and on-disk names), ``fsutil`` (atomic writes), ``hub`` (finding installed
models offline). It imports nothing of ``bundler``, ``trainer`` or ``exporter``. The command line and the demo,
which use all of them, live in the sub-package :mod:`ferry.cli`, so imports run one way::

    ferry.cli  ->  bundler / trainer / exporter  ->  ferry (errors, constants, fsutil, hub)
"""

__version__ = "0.1.0"
