"""Which sends are unique (the message's options over its actor's), and the checks of
``unique`` and ``unique_for``; a plain send's row carries no key."""

from __future__ import annotations

import dramatiq
import pytest

from dramatiq_pg_broker.errors import InvalidMessage
from dramatiq_pg_broker.sending import messages
from dramatiq_pg_broker.sending.unique import UNIQUE_SCOPE, unique_key, unique_of


@pytest.mark.parametrize(
    "options, actor_options, expected",
    [
        ({}, {}, (False, None)),
        ({"unique": True}, {}, (True, None)),
        ({"unique_for": 500}, {}, (True, 500)),
        ({"unique": True, "unique_for": 500.0}, {}, (True, 500)),
        ({}, {"unique": True}, (True, None)),
        ({}, {"unique_for": 1000}, (True, 1000)),
        ({"unique_for": 5}, {"unique_for": 1000}, (True, 5)),
        ({"unique": False}, {"unique": True, "unique_for": 1000}, (False, None)),
        ({"unique": True}, {"unique": False}, (True, None)),
        ({}, {"unique": False}, (False, None)),
    ],
)
def test_the_message_s_options_win_over_its_actor_s(options, actor_options, expected):
    assert unique_of(options, actor_options) == expected


def message(**options):
    return dramatiq.Message(
        queue_name="q", actor_name="a", args=(1,), kwargs={"k": [1, 2]}, options=options
    )


def test_a_unique_send_s_row_has_the_derived_key_in_its_own_scope():
    job, _ = messages.job_from_message(
        message(unique_for=2_000), default_max_retries=3, scope="member:7"
    )
    assert (job.idempotency_key, job.idempotency_scope) == (unique_key(message()), UNIQUE_SCOPE)
    assert job.unique_for_ms == 2_000


def test_a_plain_send_s_row_has_no_key_and_no_period():
    job, _ = messages.job_from_message(message(), default_max_retries=3)
    assert (job.idempotency_key, job.idempotency_scope, job.unique_for_ms) == (None, "", None)


def test_a_message_s_own_key_wins_over_its_actor_s_unique_option():
    job, _ = messages.job_from_message(
        message(idempotency_key="tick"), actor_options={"unique": True}, default_max_retries=3
    )
    assert (job.idempotency_key, job.idempotency_scope) == ("tick", "")
    with pytest.raises(InvalidMessage, match="cannot have an idempotency_key"):
        messages.job_from_message(
            message(idempotency_key="tick", unique=True), default_max_retries=3
        )


def test_no_other_writer_can_take_the_unique_scope():
    with pytest.raises(ValueError, match="unique jobs' own"):
        messages.idempotency_scope(UNIQUE_SCOPE)


@pytest.mark.parametrize("period", [-1, 0, 10 * 365 * 86_400_000 + 1, "1000", float("nan")])
def test_a_period_out_of_range_is_refused(period):
    with pytest.raises(InvalidMessage, match="unique_for must be an integer"):
        unique_of({"unique_for": period}, {})
