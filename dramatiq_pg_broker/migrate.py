"""``dramatiq_pg_broker.migrate``, the migrations: the documented path of
:mod:`dramatiq_pg_broker.db.migrate`, the same module under both names."""

import sys

from .db import migrate as _module

sys.modules[__name__] = _module
