"""`python -m gearshift`: the same as the `gearshift` command."""

from gearshift.cli import run

run()
