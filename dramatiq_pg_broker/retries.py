"""``dramatiq_pg_broker.retries``, the Retries middleware: the documented path of
:mod:`dramatiq_pg_broker.attempt.retries`, the same module under both names."""

import sys

from .attempt import retries as _module

sys.modules[__name__] = _module
