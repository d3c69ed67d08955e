"""Falcon resources: one module per group of endpoints, nouns with ``on_get``/``on_post``
responders. Each says where it is served (``route``) and declares its operations on its
responders (:mod:`admin_api.operations`); dependencies come through the constructors, by
the names of :class:`admin_api.app.Parts`."""
