"""The wsd client side: ``wsctl`` and the Python client library. Imports no torch."""
