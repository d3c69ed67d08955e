"""How long the hot path may queue behind the broker's own DDL: one bound for partition
maintenance (:mod:`..history.ddl`) and migrations (:mod:`.migrate`).

A DDL statement that waits for a lock makes every later request for a conflicting lock on
the same relation queue behind it: a waiting ACCESS EXCLUSIVE request on ``jobs`` stops
every send and claim until it is granted and released. So the broker's DDL never waits
long: each statement waits at most :data:`LOCK_TIMEOUT_MS` for its locks (PostgreSQL's
``lock_timeout``), and is tried again later, after the long holder it met has let go. Far
below ``deadlock_timeout`` (1 s by default), so in a lock cycle with the hot path the DDL
gives up first.
"""

from __future__ import annotations

#: The longest a DDL statement of maintenance or of a migration waits for a lock before it
#: gives up (and with it, the longest a send, claim or outcome queues behind that wait).
LOCK_TIMEOUT_MS = 50

#: A session holding a lock the DDL needs counts as brief while it runs a statement in a
#: transaction begun less than this many milliseconds ago (the hot path's own statements);
#: any other holder (idle in its transaction, a long reader, autovacuum, a prepared
#: transaction) is a long one, which the DDL waits out before it tries again.
BRIEF_HOLDER_MS = 50
