"""The wire floor: everything that turns kvxferd values into gRPC messages and back.

Below the daemon, the services and every client. :mod:`.errors` is the one error table, used
in both directions (servers abort with the status code and the ``kvxferd-error-bin`` trailer
that ``common.proto`` promises; clients rebuild the same exception from it);
:mod:`.peer_client` is the typed client of the Peer service (one place for metadata, timeouts
and error mapping). Only this package and the gRPC servicers import ``grpc``.
"""
