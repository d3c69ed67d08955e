"""``dramatiq_pg_broker.rate_limits``, the rate-limiter backend: the documented path of
:mod:`dramatiq_pg_broker.backends.rate_limits`, the same module under both names."""

import sys

from .backends import rate_limits as _module

sys.modules[__name__] = _module
