"""``dramatiq_pg_broker.workers``, the worker registry: the documented path of
:mod:`dramatiq_pg_broker.control.workers`, the same module under both names."""

import sys

from .control import workers as _module

sys.modules[__name__] = _module
