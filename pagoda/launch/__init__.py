"""Start and supervise a local Pagoda system: ``launcher`` (the system), ``child``
(one process and its output), ``supervisor`` and ``restart_policy`` (restarts,
crash loops), ``commands`` (command lines, ports), ``health`` (the standard
health Check), ``serve`` (the ``pagoda serve`` command).

Pure Python on grpcio and protobuf; it drives the services as separate
processes and imports neither them nor ``pagoda_client``.
"""
