"""The database's health as the broker sees it: :mod:`.doctor` (``dramatiq-pg-broker
doctor``, the admin API's metrics and the dashboard's health panel all read it)."""
