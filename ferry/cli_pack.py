"""CLI command `ferry pack`. Owned by the pack area; see ferry/cli.py."""

COMMANDS: list = []
