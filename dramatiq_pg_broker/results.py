"""``dramatiq_pg_broker.results``, the results backend: the documented path of
:mod:`dramatiq_pg_broker.backends.results`, the same module under both names."""

import sys

from .backends import results as _module

sys.modules[__name__] = _module
