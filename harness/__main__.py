"""`python -m harness ...` is the `duipai` command (for a checkout or worktree without its own install)."""
from harness.cli import entry

entry()
