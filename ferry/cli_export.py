"""CLI commands (export). Owned by the export area; see ferry/cli.py."""

COMMANDS: list = []
