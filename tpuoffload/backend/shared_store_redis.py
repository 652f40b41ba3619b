"""The shared tier on a Valkey/Redis server (``redis://host:6379/0``), through the ``redis`` client.

* Publish: ``SET name value NX``: the server stores the whole value or nothing and never replaces
  an existing key. Reads (``GET``) return a whole value or nil.
* ``exists_many``: one pipelined round trip of ``EXISTS`` per name (no transaction).
* Capacity is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (each
  GET refreshes recency). An evicted key reads as nil: a miss. A server without eviction answers
  writes beyond ``maxmemory`` with an OOM error: counted as a failed write.
* Every operation is bounded by ``timeout_s`` (connect and socket), with no client-side retries:
  an unreachable or slow server raises ``StoreUnavailable`` (a miss, counted); the next call
  reconnects, so a server that comes back is used again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from typing_extensions import override

from tpuoffload.backend.shared_store import SharedStore, StoreUnavailable

KEY_PREFIX = "tpuo:"


class RedisStore(SharedStore):
    """The shared store on a Valkey/Redis server (``SharedStore``'s contract): an object is published
    with SET NX, looked up with pipelined EXISTS, every call bounded by ``timeout_s``."""

    kind = "redis"

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover - setup.sh installs it
            raise ImportError("shared_url names a Redis/Valkey server: install the 'redis' Python client "
                              "(pip install redis)") from e
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                            health_check_interval=0)
        self.url = url

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreUnavailable(f"{self.url}: {type(e).__name__}: {e}") from None

    @override
    def put_if_absent(self, name: str, header: bytes, payload: Any) -> bool:
        value = header + memoryview(payload).cast("B").tobytes()
        return bool(self._call(self._client.set, KEY_PREFIX + name, value, nx=True))

    @override
    def get(self, name: str) -> bytes | None:
        return self._call(self._client.get, KEY_PREFIX + name)

    @override
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for n in names:
                pipe.exists(KEY_PREFIX + n)
            return [bool(x) for x in pipe.execute()]

        return self._call(run)

    @override
    def delete(self, name: str) -> bool:
        return bool(self._call(self._client.delete, KEY_PREFIX + name))

    @override
    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
