"""Unique jobs: at most one job per actor, queue and arguments.

A send with the ``unique`` option (or to an actor declared with it) is a send with an
idempotency key that this module derives from the message, in a scope of its own
(:data:`UNIQUE_SCOPE`): one mechanism, the ``job_keys`` table and its unique index, decides
which of two racing sends gets the job, whatever process or isolation level each runs in.
What differs from an application's idempotency key is when the key is freed (see
``move_to_history`` and ``release_unique_key`` in ``sql/queries.sql``):

- ``unique=True``: the key is held while the job waits (queued or delayed) or runs, and
  freed in the statement that ends it, whichever way it ends (succeeded, failed, cancelled
  by an operator or by an abort, failed by the reaper);
- ``unique_for=ms``: the key is held for ``ms`` milliseconds from the send, whatever the
  job's state, and in any case until the job has ended: a send after the period while the
  first job still waits or runs returns that job (see docs/guides/unique-jobs.md for why).

The key is the SHA-256 of a canonical JSON encoding of ``[queue_name, args, kwargs]``
(keys sorted, no spaces, ASCII only; tuples are lists, as Dramatiq's JSON encoder gives
them back to the actor), in hexadecimal, prefixed by its version (``u1:``). The actor's
name is not in it: ``job_keys`` is keyed by actor already. Options (delay, priority,
retries) are not part of it: the same call with another delay is the same job.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import dramatiq

from ..errors import InvalidMessage
from ..jobs.rows import UNIQUE_SCOPE

__all__ = ["UNIQUE_OPTIONS", "UNIQUE_SCOPE", "unique_key", "unique_of"]

#: The message and actor options of unique jobs (the broker declares them).
UNIQUE_OPTIONS = frozenset({"unique", "unique_for"})
#: The version of the key's encoding, its prefix.
KEY_VERSION = "u1"
#: The longest ``unique_for``: ten years, in milliseconds (as the longest delay).
MAX_UNIQUE_FOR_MS = 10 * 365 * 86_400_000

_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def unique_of(options: dict[str, Any], actor_options: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether a message with these ``options`` is unique, and its ``unique_for``
    (milliseconds, or None): the message's options win over its actor's. ``unique_for``
    makes a job unique by itself; ``unique=False`` on a message turns off its actor's
    ``unique`` and ``unique_for`` alike.

    A message with an ``idempotency_key`` of its own is not unique by its actor's options
    (the caller passes no actor options then, see ``messages.job_from_message``).

    Raises:
      InvalidMessage: ``unique`` is not a bool, or ``unique_for`` not a whole number of
        milliseconds from 1 to ten years.
    """
    unique = options.get("unique")
    if unique is None:
        unique = actor_options.get("unique")
    if unique is not None and not isinstance(unique, bool):
        raise InvalidMessage(f"unique must be True or False, got {unique!r}")
    if unique is False and "unique" in options:
        return False, None
    period = options.get("unique_for")
    if period is None:
        period = actor_options.get("unique_for")
    if period is None:
        return bool(unique), None
    if (
        isinstance(period, bool)
        or not isinstance(period, (int, float))
        or (isinstance(period, float) and not (math.isfinite(period) and period.is_integer()))
        or not 1 <= period <= MAX_UNIQUE_FOR_MS
    ):
        raise InvalidMessage(
            f"unique_for must be an integer from 1 to {MAX_UNIQUE_FOR_MS} milliseconds, "
            f"got {period!r}"
        )
    return True, int(period)


def unique_key(message: dramatiq.Message) -> str:
    """The key of a unique job: ``u1:`` and the SHA-256, in hexadecimal, of the canonical
    JSON of ``[queue_name, args, kwargs]`` (see the module's docstring).

    Raises:
      InvalidMessage: an argument is not a JSON value (a unique job's arguments must have
        one canonical encoding, whatever encoder the broker uses).
    """
    try:
        text = _CANONICAL.encode([message.queue_name, list(message.args), message.kwargs])
    except (TypeError, ValueError) as e:
        raise InvalidMessage(
            f"a unique job's arguments must be JSON values (strings, numbers, booleans, None, "
            f"lists and dicts with string keys), so that equal calls get one key: {e}"
        ) from None
    return f"{KEY_VERSION}:{hashlib.sha256(text.encode('ascii')).hexdigest()}"
