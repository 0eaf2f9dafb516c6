"""What travels between processes: torch-free.

- ``schemas``: the operations, the fields of each and their bounds;
- ``protocol``: msgpack framing, encode/decode and what decoding may cost
  (every name of ``schemas`` read as ``protocol``'s too);
- ``transport``: ZeroMQ sockets and endpoints;
- ``curve``: CURVE encryption and authentication, its key files and ZAP.
"""
