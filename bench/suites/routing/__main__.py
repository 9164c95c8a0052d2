"""`python -m bench.suites.routing`."""

import sys

from bench.suites.routing import main

sys.exit(main())
