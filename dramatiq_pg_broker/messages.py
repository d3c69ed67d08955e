"""``dramatiq_pg_broker.messages``, a message as a job row: the documented path of
:mod:`dramatiq_pg_broker.sending.messages`, the same module under both names."""

import sys

from .sending import messages as _module

sys.modules[__name__] = _module
