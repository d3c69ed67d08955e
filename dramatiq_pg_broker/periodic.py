"""``dramatiq_pg_broker.periodic``, the schedules: the documented path of
:mod:`dramatiq_pg_broker.history.periodic`, the same module under both names."""

import sys

from .history import periodic as _module

sys.modules[__name__] = _module
