"""The send path's encoding shortcut writes exactly the bytes Dramatiq's encoder writes."""

from __future__ import annotations

import dataclasses

import dramatiq
import pytest
from dramatiq.encoder import JSONEncoder

from dramatiq_pg_broker import messages


class Tagged(dramatiq.Message):
    """A Message subclass: its own asdict() must be the one used."""

    def asdict(self):
        return {**super().asdict(), "tag": 1}


class Sorted(JSONEncoder):
    """A JSONEncoder subclass: its own encode() must be the one used."""

    def encode(self, data):
        import json

        return json.dumps(data, sort_keys=True).encode()


SAMPLES = [
    dramatiq.Message(queue_name="q", actor_name="a", args=(1,), kwargs={}, options={}),
    dramatiq.Message(
        queue_name="q",
        actor_name="a",
        args=("é\u2028", [1.5, None, True, {"k": 'quote " and \\ back'}]),
        kwargs={"when": 1e20, "neg": -0.0},
        options={"eta": 5, "pipe_target": None, "idempotency_key": "ключ"},
    ),
]


@pytest.mark.parametrize("message", SAMPLES)
def test_the_stock_encoder_shortcut_writes_the_encoders_bytes(message):
    encoder = dramatiq.get_encoder()
    assert type(encoder) is JSONEncoder
    assert messages.encode(message).data == encoder.encode(message.asdict())


def test_the_shortcut_lists_every_field_of_a_message():
    assert messages._MESSAGE_FIELDS == tuple(f.name for f in dataclasses.fields(dramatiq.Message))


def test_subclasses_of_the_message_or_the_encoder_are_not_short_cut(monkeypatch):
    tagged = Tagged(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    assert b'"tag":1' in messages.encode(tagged).data
    monkeypatch.setattr(dramatiq, "get_encoder", lambda: Sorted())
    message = SAMPLES[0]
    assert messages.encode(message).data == Sorted().encode(message.asdict())
