"""What a queue's name and a queue's limit may be: one definition of each.

The settings (``queue_limits``), the control functions (pause, resume, limit), the command
line and the admin API's request models all check with these, so a name or a limit one of
them accepts is accepted by every other, and refused by every other in the same words.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidQueueLimit, InvalidQueueName

#: Dramatiq's rule for queue names: a letter or '_', then letters, digits, '.', '_' or '-'.
#: The admin API's OpenAPI document and request models carry it as this pattern; here it
#: is matched against the whole name, so that a line break at its end does not pass ``$``.
QUEUE_NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9._-]*$"

#: The longest queue name accepted.
MAX_QUEUE_NAME = 255

#: The largest queue limit accepted (a queue allowed more running jobs than this is not
#: limited in any useful sense, and the limit is stored as a PostgreSQL ``integer``).
MAX_LIMIT = 1_000_000

_QUEUE_NAME_RE = re.compile(QUEUE_NAME_PATTERN)


def check_queue_name(name: Any) -> str:
    """A queue name as Dramatiq allows it, at most :data:`MAX_QUEUE_NAME` characters.

    Raises:
      InvalidQueueName: anything else, with a sentence saying what a queue name is.
    """
    if (
        not isinstance(name, str)
        or len(name) > MAX_QUEUE_NAME
        or not _QUEUE_NAME_RE.fullmatch(name)
    ):
        shown = name if len(str(name)) <= 60 else str(name)[:60] + "..."
        raise InvalidQueueName(
            f"{shown!r} is not a queue name: a letter or '_', then letters, digits, '.', "
            f"'_' or '-', at most {MAX_QUEUE_NAME} characters"
        )
    return name


def check_limit(limit: Any) -> int:
    """A queue limit as accepted: a whole number from 1 to :data:`MAX_LIMIT`.

    Raises:
      InvalidQueueLimit: anything else, with a sentence saying what a limit must be.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidQueueLimit(
            f"a queue limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r} "
            "(to stop a queue, pause it; to lift a limit, clear it)"
        )
    return limit
