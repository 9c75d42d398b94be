"""The sans-IO core shared by ``Client`` and ``AsyncClient``.

Everything here is pure: building requests from ``pagoda.params``
(``requests``), converting responses (``convert``), retry and deadline
decisions (``retry``), the state of one call or stream (``calls``, ``stream``).
No channel, no sleeping, no clock read except through an injectable one; the
two clients are thin shells that do the gRPC I/O (sync or ``grpc.aio``) and
feed what they receive into these objects.
"""
