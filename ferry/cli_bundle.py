"""CLI commands (bundle). Owned by the bundle area; see ferry/cli.py."""

COMMANDS: list = []
