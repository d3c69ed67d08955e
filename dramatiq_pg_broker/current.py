"""``dramatiq_pg_broker.current``, the current job: the documented path of
:mod:`dramatiq_pg_broker.attempt.current`, the same module under both names."""

import sys

from .attempt import current as _module

sys.modules[__name__] = _module
