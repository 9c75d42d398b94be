"""Start and watch a local Pagoda system: ``launcher`` (the processes), ``health``
(the standard health Check), ``serve`` (the ``pagoda serve`` command).

Pure Python on grpcio and protobuf; it drives the services as separate
processes and imports neither them nor ``pagoda_client``.
"""
