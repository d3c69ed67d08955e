"""``GET /api/config``: the effective settings, without secrets. For viewers, operators and
admins: a member sees its own jobs only, not how the service is set up (the database's
host and user, every queue's limit)."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.config import Settings, mask_url

from .. import responses
from ..auth import OBSERVERS
from ..operations import operation


def public_settings(settings: Settings) -> dict:
    """The settings as the API shows them: the connection string parsed by libpq's own
    parser, its secrets masked (:func:`dramatiq_pg_broker.config.mask_url`)."""
    data = settings.public()
    data["url"] = mask_url(settings.url) or None
    return data


class Config:
    route = "/api/config"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @operation(
        roles=OBSERVERS,
        summary="The effective settings, without secrets.",
        responses={200: (responses.Settings, "The settings.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = public_settings(self.settings)
