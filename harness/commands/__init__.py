"""The click commands of `duipai`, one module per command or small group; harness/cli.py assembles them.
Only these modules and harness/cli.py import click: the work is done by the library modules they call."""
