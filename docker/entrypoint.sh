#!/bin/sh
# Container entrypoint: the offline environment written by install.py, then ferry.
set -eu
. "${FERRY_HOME:-/opt/ferry}/ferry.env"
exec ferry "$@"
