"""Redis Cluster for django-redis caches: ``OPTIONS["CONNECTION_FACTORY"]`` names this module's
:class:`ClusterConnectionFactory`.

django-redis speaks to one Redis server per ``LOCATION``; against a cluster that answers
``MOVED`` for four keys in five. redis-py's ``RedisCluster`` follows the cluster's slot map
itself, with a connection pool per node, and takes a new map when a failover moves a slot. The
Redis copy sends single-key commands only (see :mod:`django_idempotency.request.redis_copy`), so it
needs nothing else from the client.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from django_redis.pool import ConnectionFactory

__all__ = ["ClusterConnectionFactory"]


class ClusterConnectionFactory(ConnectionFactory):  # type: ignore[misc]  # django-redis is untyped
    """One ``redis.cluster.RedisCluster`` per process and location, shared by every thread.

    ``LOCATION`` is the URL of any node (the client learns the others from it); ``SOCKET_TIMEOUT``,
    ``SOCKET_CONNECT_TIMEOUT``, ``USERNAME`` and ``PASSWORD`` apply to every node, and
    ``REDIS_CLIENT_KWARGS`` go to ``RedisCluster`` as they are (``retry``,
    ``require_full_coverage``, ...). Django makes a cache object per thread and django-redis a
    client per cache object, so the cluster client is kept here: built once, it is not built
    again (a ``CLUSTER SLOTS`` round trip each time) for every thread.
    """

    _clusters: ClassVar[dict[str, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def connect(self, url: str) -> Any:
        params = self.make_connection_params(url)
        identity = f"{url} {sorted(self.options.items(), key=lambda item: item[0])!r}"
        with self._lock:
            cluster = self._clusters.get(identity)
            if cluster is None:
                # Made under the lock: the first requests of a process after a deploy all
                # arrive at once, and one slot-map fetch is enough for all of them.
                cluster = self._clusters[identity] = self.get_connection(params)
        return cluster

    def get_connection(self, params: dict[str, Any]) -> Any:
        from redis.cluster import RedisCluster

        kwargs = {name: value for name, value in params.items() if name != "url"}
        kwargs.update(self.redis_client_cls_kwargs)
        return RedisCluster.from_url(params["url"], **kwargs)

    def disconnect(self, connection: Any) -> None:
        """Close every node's idle sockets, as django-redis does with its one pool; the client
        stays usable and reconnects on its next command."""
        connection.disconnect_connection_pools()
