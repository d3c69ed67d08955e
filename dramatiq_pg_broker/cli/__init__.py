"""``dramatiq-pg-broker``: the command line (``main``), its operator commands (jobs) and
operator control (control)."""

from .main import build_parser, main, settings_from

__all__ = ["build_parser", "main", "settings_from"]
