"""Reading a job id or a prefix of one, before any database is asked."""

from __future__ import annotations

import uuid

import pytest

from dramatiq_pg_broker import InvalidJobId
from dramatiq_pg_broker.jobs import MIN_ID_PREFIX, id_prefix_range

JOB_ID = "3dd0ad24-1f6b-4c1e-9a57-0d7f2a9b8c01"


@pytest.mark.parametrize(
    "text",
    [JOB_ID, JOB_ID.upper(), JOB_ID.replace("-", ""), f"{{{JOB_ID}}}", f"urn:uuid:{JOB_ID}"],
)
def test_a_whole_id_in_any_form_is_returned_canonical(text):
    assert id_prefix_range(f" {text} ") == JOB_ID


@pytest.mark.parametrize("text", ["3dd0ad24", "3DD0AD24", "3dd0ad24-1f", "3dd0ad241f"])
def test_a_prefix_becomes_the_range_of_ids_that_start_with_it(text):
    low, high = id_prefix_range(text)
    digits = text.lower().replace("-", "")
    assert low.replace("-", "") == digits.ljust(32, "0")
    assert high.replace("-", "") == digits.ljust(32, "f")
    assert uuid.UUID(low) <= uuid.UUID(JOB_ID) <= uuid.UUID(high)


def test_the_shortest_prefix_is_eight_characters():
    assert MIN_ID_PREFIX == 8
    with pytest.raises(InvalidJobId, match="'3dd0ad2' is too short: give at least 8 hex"):
        id_prefix_range("3dd0ad2")


@pytest.mark.parametrize("text", ["", "   ", "3dd0ad2g", "not-a-uuid", JOB_ID + "0", "3dd0 ad24"])
def test_anything_else_is_not_a_job_id(text):
    with pytest.raises(InvalidJobId, match="is not a job id: give the UUID, or at least"):
        id_prefix_range(text)


def test_an_invalid_job_id_is_a_value_error():
    assert issubclass(InvalidJobId, ValueError)
