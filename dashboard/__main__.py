"""`python -m dpool.dashboard --coordinator ADDR ...`: what `dpd run --dashboard` starts."""

import sys

from dpool.dashboard.cli import main

sys.exit(main())
