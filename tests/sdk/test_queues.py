"""What a producer knows of each queue (producer_sdk/core/queues.py), without Redis: the config hash's
replies are handed to the book as a client's plan would hand them."""

from __future__ import annotations

import pytest

from tokenrelay.producer_sdk.core.queues import DEFAULT_MAX_QUEUED_JOBS
from tokenrelay.producer_sdk.core.effects import run
from tokenrelay.producer_sdk.core.queues import LIMIT_FIELD, TOKENS_FIELD, QueueBook
from tokenrelay.protocol.shards import SHARDS_FIELD, ShardCountMismatch


class ConfigHash:
    """A Redis whose only data is one queue config hash (``HMGET`` of it)."""

    def __init__(self, limit: object = None, shards: object = None,
                 tokens: object = None) -> None:
        self.limit, self.shards, self.tokens, self.reads = limit, shards, tokens, 0

    def hmget(self, key: str, fields: list[str]) -> list[object]:
        self.reads += 1
        values = {LIMIT_FIELD: self.limit, SHARDS_FIELD: self.shards, TOKENS_FIELD: self.tokens}
        return [values[f] for f in fields]


def test_the_limit_is_the_clients_own_else_the_hashs_else_the_default():
    assert QueueBook("ns", "q", None, None).store(None, b"7", None).limit == 7
    assert QueueBook("ns", "q", None, 3).store(None, b"7", None).limit == 3
    assert QueueBook("ns", "q", None, None).store(None, None, None).limit == \
        DEFAULT_MAX_QUEUED_JOBS
    assert QueueBook("ns", "q", None, None).store(None, b"many", None).limit == \
        DEFAULT_MAX_QUEUED_JOBS


def test_the_token_budget_is_the_clients_own_else_the_hashs_else_none():
    assert QueueBook("ns", "q", None, None).store(None, None, None, b"5000").token_limit == 5000
    assert QueueBook("ns", "q", None, None, 70).store(None, None, None, b"5000").token_limit == 70
    assert QueueBook("ns", "q", None, None).store(None, None, None, None).token_limit == 0
    assert QueueBook("ns", "q", None, None).store(None, None, None, b"x").token_limit == 0
    st = QueueBook("ns", "q", 3, None, 1000).store(None, None, None)
    assert st.shard_tokens() == 334                          # split over 3 shards, rounded up


def test_a_queue_is_read_once_and_again_only_when_fresh_is_due():
    book, redis_ = QueueBook("ns", "q", None, None), ConfigHash(limit=b"5")
    assert run(book.state(), lambda: redis_).limit == 5
    assert run(book.state(), lambda: redis_).limit == 5 and redis_.reads == 1
    book.cached().expires = 0.0                         # as CONFIG_TTL_S later
    redis_.limit = b"9"
    assert run(book.state(fresh=True), lambda: redis_).limit == 9 and redis_.reads == 2


def test_an_unregistered_count_follows_a_registration_and_a_registered_one_is_kept():
    book = QueueBook("ns", "q", None, None)
    assert book.store(None, None, None).keys.shards == 1
    assert book.store(None, None, b"4").keys.shards == 4     # the workers registered 4
    assert book.store(None, None, None).keys.shards == 4     # the field deleted: still 4
    with pytest.raises(ShardCountMismatch, match="resharded"):
        book.store(None, None, b"2")
    other = book.store("other", None, None)                  # the client's shards: its queue only
    assert other.keys.queue == "other" and other.keys.shards == 1
