"""`python -m gearshift`: the same as the `gearshift` command."""

import sys

from gearshift.cli import main

sys.exit(main())
