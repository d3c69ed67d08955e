"""Dramatiq backends on PostgreSQL: results, rate limits, dramatiq-abort's events."""
