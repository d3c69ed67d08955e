"""``python -m dramatiq_pg_broker.cli``."""

import sys

from .main import main

sys.exit(main())
