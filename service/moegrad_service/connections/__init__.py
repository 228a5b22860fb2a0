"""Connections below the application: the HTTP protocol, the body sink and the draining server.

uvicorn runs the service; this package bounds what a connection may cost before the application
sees it, reads bodies without copies, and stops gracefully:

- :mod:`._protocol`: :func:`guarded_protocol`, uvicorn's httptools protocol with a bounded request
  head (431, 408) and a *lingering* close (an early answer is not destroyed by a reset);
- :mod:`._body`: :data:`BODY_INTO`, the scope extension through which a handler has its body read
  from the socket straight into its own buffer (``recv_into``), the sink that does it, and
  :class:`Received`, its bytes counted as they arrive;
- :mod:`._server`: :class:`DrainingServer`, uvicorn's server draining on SIGTERM (503 +
  ``Connection: close`` while the port stays open), answering its accept backlog at shutdown, with
  the collector's generations frozen once started;
- :mod:`._uvicorn_private`: the only module that touches uvicorn's and httptools' private members,
  each through a named accessor; its docstring lists every member and why it is used.
"""

from __future__ import annotations

from moegrad_service.connections._body import BODY_INTO, Received
from moegrad_service.connections._protocol import LINGER_BYTES, LINGER_S, guarded_protocol
from moegrad_service.connections._server import DrainingServer

__all__ = ["BODY_INTO", "LINGER_BYTES", "LINGER_S", "DrainingServer", "Received", "guarded_protocol"]
