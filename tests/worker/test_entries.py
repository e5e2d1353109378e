"""worker/entries.py: the held entry, and the lanes one consumer reads, in which order, and how
urgent an entry of each is."""

from __future__ import annotations

import redis

from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.entries import (AFFINITY_LANE, Entry, Lanes, by_lane, entry_fields, is_nogroup,
                            own_streams)


def test_lanes_visit_own_affinity_streams_then_the_lanes_most_urgent_first_across_shards():
    keys = Keys("ns", "q", 2)
    lanes = Lanes(keys, "w1")
    names = [name for name, _ in lanes.all]
    assert names == [AFFINITY_LANE] * 2 + ["urgent"] * 2 + ["default"] * 2 + ["bulk"] * 2
    assert [key for name, key in lanes.all if name == AFFINITY_LANE] == own_streams(keys, "w1")
    assert lanes.streams(1) == [keys.affinity("w1", 1), *keys.lanes(1)]
    assert lanes.name(keys.lane("bulk", 1)) == "bulk"
    assert lanes.name(keys.affinity("dead-worker", 0)) == AFFINITY_LANE   # any other stream


def held(keys: Keys, lane: str, entry_id: str, shard: int) -> Entry:
    stream = keys.affinity("w1", shard) if lane == AFFINITY_LANE else keys.lane(lane, shard)
    return Entry(lane, stream, entry_id, {}, 1, "new", shard)


def test_urgency_ranks_lane_then_age_then_the_shards_turn():
    keys = Keys("ns", "q", 2)
    lanes = Lanes(keys, "w1")
    entries = [held(keys, "bulk", "1-0", 0), held(keys, "default", "5-0", 0),
               held(keys, "default", "3-0", 1), held(keys, "urgent", "9-0", 1),
               held(keys, AFFINITY_LANE, "9-1", 0), held(keys, "default", "3-0", 0)]
    assert lanes.shard_order() == [1, 0] and lanes.first == 1     # shard 1's turn now
    ranked = sorted(entries, key=lanes.urgency)
    assert [(x.lane, x.entry_id, x.shard) for x in ranked] == [
        (AFFINITY_LANE, "9-1", 0), ("urgent", "9-0", 1), ("default", "3-0", 1),
        ("default", "3-0", 0), ("default", "5-0", 0), ("bulk", "1-0", 0)]


def test_entry_fields_payload_and_age():
    flat = entry_fields([b"data", b"x", "other", b"y"])
    assert flat == {b"data": b"x", b"other": b"y"} and entry_fields({"data": b"x"}) == {
        b"data": b"x"}
    e = Entry("default", "lane", "1700000000123-4", flat)
    assert e.payload == b"x" and e.key == ("lane", "1700000000123-4")
    assert e.enqueued_ms == 1700000000123
    gone = Entry("default", "lane", "not-an-id", None)
    assert gone.payload is None and gone.enqueued_ms == 0


def test_by_lane_keeps_order_and_nogroup_is_recognised():
    assert by_lane([("a", 1), ("b", 2), ("a", 3)]) == {"a": [1, 3], "b": [2]}
    assert is_nogroup(redis.ResponseError("NOGROUP No such key"))
    assert is_nogroup(redis.ResponseError("the stream key no longer exists"))
    assert not is_nogroup(redis.ResponseError("WRONGTYPE")) and not is_nogroup(ValueError())
