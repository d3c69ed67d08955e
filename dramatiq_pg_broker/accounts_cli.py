"""CLI commands for admin API accounts (users and tokens). Filled in by the admin API work."""
