"""CLI commands (demo). Owned by the demo area; see ferry/cli.py."""

COMMANDS: list = []
