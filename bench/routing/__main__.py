"""`python -m bench.routing`."""

import sys

from bench.routing import main

sys.exit(main())
