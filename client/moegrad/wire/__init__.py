"""The wire: the v1 msgpack codec, the frames body and the bounds on a body's structure (docs/protocol.md)."""
