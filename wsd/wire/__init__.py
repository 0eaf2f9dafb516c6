"""What travels between processes: torch-free.

- ``protocol``: the messages, their schemas and bounds, msgpack framing;
- ``transport``: ZeroMQ sockets and endpoints;
- ``curve``: CURVE encryption and authentication, its key files and ZAP.
"""
