"""``GET /api/config``: the effective settings, without secrets."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.config import Settings, mask_url

from ..auth import READERS


def public_settings(settings: Settings) -> dict:
    """The settings as the API shows them: the connection string parsed by libpq's own
    parser, its secrets masked (:func:`dramatiq_pg_broker.config.mask_url`)."""
    data = settings.public()
    data["url"] = mask_url(settings.url) or None
    return data


class Config:
    permissions = {"GET": READERS}

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = public_settings(self.settings)
