"""Integrations with frameworks, each importable only where its framework is installed:
nothing in the broker imports them."""
