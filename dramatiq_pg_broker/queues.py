"""``dramatiq_pg_broker.queues``, queue control: the documented path of
:mod:`dramatiq_pg_broker.control.queues`, the same module under both names."""

import sys

from .control import queues as _module

sys.modules[__name__] = _module
