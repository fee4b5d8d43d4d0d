"""Generated code of the wire contract ``kvxferd.v1`` (``proto/kvxferd/v1/*.proto``).

Every ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*.pyi`` here is generated: do not edit them. Change
the ``.proto`` files, then regenerate with ``python scripts/gen_proto.py`` and check in the
result; ``scripts/check_proto.sh`` (run in CI) fails when they drift. This ``__init__`` is the
only hand-written file and imports nothing, so importing one service's module stays cheap.

Modules: ``spec_pb2`` (KV cache spec, region registration), ``common_pb2`` (block IDs, error
detail, release reason), ``peer_pb2``/``peer_pb2_grpc`` (service ``Peer``),
``scheduler_pb2``/``scheduler_pb2_grpc`` (service ``Scheduler``), ``engine_pb2``/
``engine_pb2_grpc`` (service ``Engine``).
"""
