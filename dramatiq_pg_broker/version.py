"""The package version, in one place: setup.cfg reads it (``attr:``), and so do the
package (``dramatiq_pg_broker.__version__``), the admin API's OpenAPI document and
``dramatiq-pg-broker --version``."""

__version__ = "0.2.0.dev0"
