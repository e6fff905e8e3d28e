"""The portal: a small web UI the API service serves under /ui (services/api/portal/web.py)."""

from services.api.portal.web import mount

__all__ = ["mount"]
