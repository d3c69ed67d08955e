"""``GET /api/config``: the effective settings, without secrets."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.config import Settings, mask_url

from ..auth import READERS


def public_settings(settings: Settings) -> dict:
    """The settings as the API shows them: the URL without its password or query string
    (which may carry one)."""
    data = settings.public()
    data["url"] = mask_url((settings.url or "").split("?")[0]) or None
    return data


class Config:
    permissions = {"GET": READERS}

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = public_settings(self.settings)
