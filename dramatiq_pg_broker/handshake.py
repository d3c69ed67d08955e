"""``dramatiq_pg_broker.handshake``, the schema handshake: the documented path of
:mod:`dramatiq_pg_broker.db.handshake`, the same module under both names."""

import sys

from .db import handshake as _module

sys.modules[__name__] = _module
