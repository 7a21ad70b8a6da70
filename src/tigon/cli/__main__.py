"""`python -m tigon.cli ...`: the `tigon` command."""

import sys

from . import main

sys.exit(main())
