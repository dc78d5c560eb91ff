"""CLI commands (train). Owned by the train area; see ferry/cli.py."""

COMMANDS: list = []
