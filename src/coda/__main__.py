"""`python -m coda ...`: see coda.cli."""

import sys

from .cli import main

sys.exit(main())
