"""A stand-in for Django's PostgreSQL backend on psycopg2 (what Django before 4.2 uses):
only what the integration's start-up check reads (``ENGINE`` names this package)."""
