"""One Redis server or a Redis Cluster: detected from any node's URL, and the one place that
sends packed commands to the node that holds their keys.

Every tokenrelay command line, the SDK clients and the worker get their Redis client from
``make_client`` (sync) or ``make_async_client``: given the URL of any node, ``cluster=None``
asks the server (``INFO cluster``) and returns redis-py's ``RedisCluster`` when cluster mode is
on, a plain ``Redis`` otherwise; ``cluster=True``/``False`` forces it (``--cluster on|off``).

Ordinary commands go through that client, which routes them by key. The hot paths (the worker's
per-step script calls, the producers' enqueue rounds, a durable submit's WAIT) pack commands
themselves and call ``send_packed`` / ``async_send_packed``: commands are grouped by the node
that serves their routing key, every node's group is written before any reply is read, so a
batch costs one round trip per node however many jobs it carries. A cluster that moved a slot
(MOVED/ASK) or lost a node (failover) makes the sender refresh the slot map; MOVED commands are
resent once to the new owner, a lost connection is raised for the caller's own retry (all our
scripts are idempotent: dedupe records, batch ids, XPENDING-checked acks).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import redis
import redis.asyncio
from redis.cluster import RedisCluster
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from tokenrelay.protocol.slot_routing import AsyncSlotRoutedCluster, SlotRoutedCluster

Key = Union[str, bytes]
# (routing key, one or more RESP-packed commands whose keys all hash to that key's slot,
#  how many commands the bytes hold). The bytes may come as a function that packs them: such a
# batch is sent streamed (``_stream``), each item packed just before it is written while Redis
# runs the ones before, its replies read a few items behind.
Packed = tuple[Optional[Key], Union[bytes, Callable[[], bytes]], int]
# How many items a streamed send writes ahead of the replies it reads (Redis is never idle).
STREAM_AHEAD = 4

CLUSTER_MODES = {"auto": None, "on": True, "off": False}


class ClusterModeError(RuntimeError):
    """``--cluster on`` against a server that is not a cluster node (or cannot say)."""


def cluster_flag(mode: Union[str, bool, None]) -> Optional[bool]:
    """``auto``/``on``/``off`` (a flag's value) as None/True/False."""
    if mode is None or isinstance(mode, bool):
        return mode
    try:
        return CLUSTER_MODES[str(mode).lower()]
    except KeyError:
        raise ValueError(f"cluster mode must be one of {sorted(CLUSTER_MODES)}; got {mode!r}") \
            from None


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def detect_cluster(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at ``url`` runs in cluster mode. Asks ``CLUSTER INFO`` (a server
    without cluster support says so in an error: no), the one command the least-privilege
    roles of docs/operations.md allow for it (``+cluster|info``); a user without it is asked
    ``INFO cluster``, and a user allowed neither is taken to be on one Redis (a cluster's users
    pass ``--cluster on``). Connection errors propagate: the caller reports an unreachable
    Redis."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        try:
            client.execute_command("CLUSTER", "INFO")
            return True
        except redis.exceptions.NoPermissionError:
            pass
        except redis.ResponseError as exc:
            if "cluster support disabled" in str(exc).lower():
                return False
            raise
        try:
            return bool(client.info("cluster").get("cluster_enabled"))
        except redis.exceptions.NoPermissionError:
            return False
    finally:
        client.close()


def is_cluster(client: Any) -> bool:
    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def _cluster_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A plain client's settings that RedisCluster does not take (it routes and retries by
    itself; a cluster has no database number but 0)."""
    out = dict(kwargs)
    for k in ("retry_on_error", "health_check_interval", "db"):
        out.pop(k, None)
    return out


def make_client(url: str, cluster: Optional[bool] = None, **kwargs: Any) -> Any:
    """A sync client for ``url``: RedisCluster when the server is a cluster node (or
    ``cluster=True``), else redis.Redis; ``kwargs`` are the usual connection settings."""
    if cluster is None:
        cluster = detect_cluster(url, float(kwargs.get("socket_connect_timeout") or 2.0))
    if not cluster:
        return redis.Redis.from_url(url, **kwargs)
    return SlotRoutedCluster.from_url(url, **_cluster_kwargs(kwargs))


def make_async_client(url: str, cluster: Optional[bool] = None,
                      max_connections: Optional[int] = None,
                      pool_timeout_s: Optional[float] = None, **kwargs: Any) -> Any:
    """``make_client`` for asyncio. Detection (``cluster=None``) is one short blocking call when
    the client is made, not on every command. ``max_connections`` bounds the pool (per node of
    a cluster); on one Redis the pool then waits up to ``pool_timeout_s`` for a free connection
    (``BlockingConnectionPool``) instead of raising at once. A cluster client's nodes raise
    ``MaxConnectionsError`` (a ConnectionError) when full, which the SDK's plans retry."""
    if cluster is None:
        cluster = detect_cluster(url, float(kwargs.get("socket_connect_timeout") or 2.0))
    if not cluster:
        if max_connections is None:
            return redis.asyncio.Redis.from_url(url, **kwargs)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **kwargs)
        client = redis.asyncio.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True
        return client
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    return AsyncSlotRoutedCluster.from_url(url, **_cluster_kwargs(kwargs))


def node_name(client: Any, key: Key) -> Optional[str]:
    """The name of the master serving ``key`` (None for a plain client), for callers that
    plan per node (which of a node's commands may block). An asyncio cluster client must have
    been initialized (any command, or ``await client.initialize()``)."""
    if not is_cluster(client):
        return None
    return client.get_node_from_key(key).name


def slot(key: Key) -> int:
    from redis.crc import key_slot
    return key_slot(key.encode() if isinstance(key, str) else key)


# ------------------------------------------------------------------------------ sync
def node_client(client: Any, key: Key) -> redis.Redis:
    """The plain client of the master that serves ``key`` (``client`` itself when it is not a
    cluster client): for commands that must run on that node's connection (WAIT after a write,
    a blocking XREADGROUP)."""
    if not isinstance(client, RedisCluster):
        return client
    node = client.get_node_from_key(key)
    return client.get_redis_connection(node)


def refresh(client: Any) -> None:
    """Re-read the cluster's slot map (after MOVED, a lost node or a failover); never raises:
    a cluster that cannot answer yet is asked again on the next error."""
    if isinstance(client, RedisCluster):
        with contextlib.suppress(Exception):
            client.nodes_manager.initialize()


def _group(client: Any, items: Sequence[Packed]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    cluster = isinstance(client, RedisCluster)
    for i, (key, _, _) in enumerate(items):
        if cluster:
            node = (client.get_node_from_key(key) if key is not None
                    else client.get_default_node())
            groups.setdefault(node.name, []).append(i)
        else:
            groups.setdefault(None, []).append(i)
    return groups


@contextlib.contextmanager
def _pooled(client: Any, name: Any) -> Iterator[Any]:
    plain = client if name is None else client.get_redis_connection(client.get_node(node_name=name))
    pool = plain.connection_pool
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def send_packed(client: Any, items: Sequence[Packed]) -> list[Any]:
    """Send each item's packed commands to the node of its routing key and return every
    command's reply, in order, flattened (error replies in place, never raised). Connection
    errors propagate after a cluster refresh; MOVED/ASK replies are resent once after one."""
    return send_packed_trailed(client, items, None)[0]


def send_packed_trailed(client: Any, items: Sequence[Packed],
                        trailer: Optional[bytes]) -> tuple[list[Any], list[Any]]:
    """``send_packed`` with one more packed command (``trailer``, e.g. ``WAIT 1 1000``) sent
    after each node's batch on the same connection: what must follow the writes of that very
    connection (WAIT counts the replicas that acknowledged the connection's own writes).
    Returns the flattened replies and, per item, the trailer's reply of the node it went to
    (None when ``trailer`` is None)."""
    replies, trailed = _send_once(client, items, trailer)
    if isinstance(client, RedisCluster):
        moved = _moved(items, replies)
        if moved:
            refresh(client)
            again, again_trailed = _send_once(client, [items[i] for i in moved], trailer)
            _splice(items, replies, moved, again)
            _splice(items, trailed, moved, again_trailed)
    return [r for rs in replies for r in rs], trailed


def _read_one(conn: Any) -> Any:
    try:
        return conn.read_response()
    except redis.ResponseError as exc:
        return exc


def _data(item: Packed) -> bytes:
    """An item's packed bytes (packed now when it carries a function that packs them)."""
    data = item[1]
    return data() if callable(data) else data


def _streamed(items: Sequence[Packed], groups: dict[Any, list[int]]) -> bool:
    """A batch for one node whose bytes are packed on demand: sent by ``_stream``."""
    return len(groups) == 1 and len(items) > 1 and callable(items[0][1])


def _stream(conn: Any, items: Sequence[Packed], idx: list[int], replies: list[list[Any]],
            tail: list[bytes]) -> None:
    """Write each item as soon as it is packed, reading replies ``STREAM_AHEAD`` items behind:
    the producer packs (and parses) while Redis runs what was written before, instead of
    Redis waiting for the whole batch to be packed and the producer for the whole batch to
    run (a bulk enqueue's packing and its scripts then overlap)."""
    done = 0
    for k, i in enumerate(idx):
        conn.send_packed_command([_data(items[i])], check_health=False)
        while done < k - STREAM_AHEAD:
            j = idx[done]
            replies[j].extend(_read_one(conn) for _ in range(items[j][2]))
            done += 1
    if tail:
        conn.send_packed_command(tail, check_health=False)
    for j in idx[done:]:
        replies[j].extend(_read_one(conn) for _ in range(items[j][2]))


def _send_once(client: Any, items: Sequence[Packed],
               trailer: Optional[bytes] = None) -> tuple[list[list[Any]], list[Any]]:
    groups = _group(client, items)
    replies: list[list[Any]] = [[] for _ in items]
    trailed: list[Any] = [None] * len(items)
    tail = [trailer] if trailer is not None else []
    try:
        with contextlib.ExitStack() as stack:
            conns = {name: stack.enter_context(_pooled(client, name)) for name in groups}
            if _streamed(items, groups):
                ((name, idx),) = groups.items()
                _stream(conns[name], items, idx, replies, tail)
                if trailer is not None:
                    last = _read_one(conns[name])
                    for i in idx:
                        trailed[i] = last
                return replies, trailed
            for name, idx in groups.items():  # every node's commands go out before any read
                conns[name].send_packed_command(
                    [b"".join([*(_data(items[i]) for i in idx), *tail])], check_health=False)
            for name, idx in groups.items():
                conn = conns[name]
                for i in idx:
                    replies[i].extend(_read_one(conn) for _ in range(items[i][2]))
                if trailer is not None:
                    last = _read_one(conn)
                    for i in idx:
                        trailed[i] = last
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        refresh(client)
        raise
    return replies, trailed


def _moved(items: Sequence[Packed], replies: list[list[Any]]) -> list[int]:
    return [i for i, rs in enumerate(replies)
            if any(isinstance(r, redis.ResponseError) and _is_redirect(r) for r in rs)]


def _is_redirect(exc: Exception) -> bool:
    return (isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError))
            or _text(exc).startswith(("MOVED", "ASK")))


def _splice(items: Sequence[Packed], replies: list[Any], idx: list[int],
            again: list[Any]) -> None:
    for i, rs in zip(idx, again):
        replies[i] = rs


# ------------------------------------------------------------------------------ asyncio
async def async_send_packed(client: Any, items: Sequence[Packed]) -> list[Any]:
    """``send_packed`` for asyncio clients (plain or cluster)."""
    return (await async_send_packed_trailed(client, items, None))[0]


async def async_send_packed_trailed(client: Any, items: Sequence[Packed],
                                    trailer: Optional[bytes]) -> tuple[list[Any], list[Any]]:
    """``send_packed_trailed`` for asyncio clients."""
    replies, trailed = await _async_send_once(client, items, trailer)
    if isinstance(client, AsyncRedisCluster):
        moved = _moved(items, replies)
        if moved:
            await _async_refresh(client)
            again, again_trailed = await _async_send_once(client, [items[i] for i in moved],
                                                          trailer)
            _splice(items, replies, moved, again)
            _splice(items, trailed, moved, again_trailed)
    return [r for rs in replies for r in rs], trailed


async def async_refresh(client: Any) -> None:
    """``refresh`` for an asyncio cluster client; never raises."""
    with contextlib.suppress(Exception):
        await client.nodes_manager.initialize()


_async_refresh = async_refresh


def refresh_any(client: Any) -> Any:
    """Re-read the slot map of any client: None once done (sync, or not a cluster), or the
    coroutine that does it for an asyncio cluster client."""
    if isinstance(client, AsyncRedisCluster):
        return async_refresh(client)
    refresh(client)
    return None


async def _async_send_once(client: Any, items: Sequence[Packed], trailer: Optional[bytes] = None,
                           ) -> tuple[list[list[Any]], list[Any]]:
    replies: list[list[Any]] = [[] for _ in items]
    trailed: list[Any] = [None] * len(items)
    tail = [trailer] if trailer is not None else []
    if isinstance(client, AsyncRedisCluster):
        await client.initialize()  # loads the slot map on first use, a no-op afterwards
        groups: dict[Any, tuple[Any, list[int]]] = {}
        for i, (key, _, _) in enumerate(items):
            node = (client.get_node_from_key(key) if key is not None
                    else client.get_default_node())
            groups.setdefault(node.name, (node, []))[1].append(i)
        acquired = [(node, node.acquire_connection(), idx) for node, idx in groups.values()]
        try:
            for _, conn, idx in acquired:
                await conn.send_packed_command([b"".join([*(_data(items[i]) for i in idx),
                                                          *tail])], check_health=False)
            for _, conn, idx in acquired:
                await _async_read(conn, items, idx, replies, trailed, trailer is not None)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            for _, conn, _ in acquired:
                with contextlib.suppress(Exception):
                    await conn.disconnect()
            await _async_refresh(client)
            raise
        finally:
            for node, conn, _ in acquired:
                node.release(conn)
        return replies, trailed
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        if _streamed(items, {None: list(range(len(items)))}):
            await _async_stream(conn, items, replies, tail)
            if trailer is not None:
                last = await _async_read_one(conn)
                trailed = [last] * len(items)
        else:
            await conn.send_packed_command([b"".join([*(_data(it) for it in items), *tail])],
                                           check_health=False)
            await _async_read(conn, items, range(len(items)), replies, trailed,
                              trailer is not None)
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)
    return replies, trailed


async def _async_read_one(conn: Any) -> Any:
    try:
        return await conn.read_response()
    except redis.ResponseError as exc:
        return exc


async def _async_stream(conn: Any, items: Sequence[Packed], replies: list[list[Any]],
                        tail: list[bytes]) -> None:
    """``_stream`` for an asyncio connection to one Redis."""
    done = 0
    for k, item in enumerate(items):
        await conn.send_packed_command([_data(item)], check_health=False)
        while done < k - STREAM_AHEAD:
            for _ in range(items[done][2]):
                replies[done].append(await _async_read_one(conn))
            done += 1
    if tail:
        await conn.send_packed_command(tail, check_health=False)
    for j in range(done, len(items)):
        for _ in range(items[j][2]):
            replies[j].append(await _async_read_one(conn))


async def _async_read(conn: Any, items: Sequence[Packed], idx: Any, replies: list[list[Any]],
                      trailed: list[Any], trailer: bool) -> None:
    for i in idx:
        for _ in range(items[i][2]):
            replies[i].append(await _async_read_one(conn))
    if trailer:
        last = await _async_read_one(conn)
        for i in idx:
            trailed[i] = last

def redact_url(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"
