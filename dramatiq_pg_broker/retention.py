"""``dramatiq_pg_broker.retention``, retention: the documented path of
:mod:`dramatiq_pg_broker.history.retention`, the same module under both names."""

import sys

from .history import retention as _module

sys.modules[__name__] = _module
