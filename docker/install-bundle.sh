#!/bin/sh
# Install a ferry bundle into PREFIX with no network; what the Dockerfile runs, and what CI tests
# (tests/e2e/test_main_job.py runs this very script under `unshare -rn`).
#   usage: install-bundle.sh BUNDLE_DIR PREFIX [install.py options, e.g. --no-compile]
set -eu
bundle=${1:?usage: install-bundle.sh BUNDLE_DIR PREFIX [install.py options]}
prefix=${2:?usage: install-bundle.sh BUNDLE_DIR PREFIX [install.py options]}
shift 2
python3 "$bundle/install.py" --prefix "$prefix" "$@"
# The installed environment must work offline: load ferry.env and ask the CLI for its version.
. "$prefix/ferry.env"
ferry --version
