import pytest
import redis

from tests.support.proxy import tcp_proxy


def test_proxy_forwards_and_cuts(redis_url):
    with tcp_proxy(redis_url, 6379) as proxy:
        client = redis.Redis.from_url(proxy.url_for(redis_url), socket_timeout=2)
        assert client.ping()
        proxy.cut()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        proxy.restore()
        assert client.ping()
