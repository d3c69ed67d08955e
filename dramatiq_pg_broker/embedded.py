"""``dramatiq_pg_broker.embedded``, the local PostgreSQL: the documented path of
:mod:`dramatiq_pg_broker.db.embedded`, the same module under both names."""

import sys

from .db import embedded as _module

sys.modules[__name__] = _module
