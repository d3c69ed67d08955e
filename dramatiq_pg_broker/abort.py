"""``dramatiq_pg_broker.abort``, dramatiq-abort's event backend: the documented path of
:mod:`dramatiq_pg_broker.backends.abort`, the same module under both names."""

import sys

from .backends import abort as _module

sys.modules[__name__] = _module
