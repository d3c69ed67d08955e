"""Falcon resources: one module per group of endpoints, nouns with ``on_get``/``on_post``
responders. Dependencies come through the constructors; permissions are declared on each
resource and enforced by :class:`admin_api.auth.Authentication`."""
