"""Job streams no worker reads are listed, with their depth, by ``producer_sdk stats`` and
``tokenrelay admin unread``, and a job sitting in one has the status ``stranded``
(issue #25). The stray layout is made as an operator would make it: jobs enqueued while the
queue was registered with 1 shard, then the count changed to 3 without draining."""

from __future__ import annotations

import json

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.cli.main import main as sdk_main
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.lanes import NO_GROUP, OUTSIDE_LAYOUT, unread_lanes
from tokenrelay.protocol.shards import SHARDS_FIELD
from tokenrelay.worker import admin

pytestmark = pytest.mark.timeout(60)

NS = "ul"


def test_lanes_outside_the_layout_and_without_group_are_listed_and_jobs_there_stranded(
        redis_server, capsys):
    r = redis_server.client()
    url = ["--redis-url", redis_server.url, "--namespace", NS]
    with Client(redis_server.url, namespace=NS, queue="q") as old:
        jobs = old.submit_many([f"p{i}" for i in range(5)], max_tokens=2)
        assert old.status(jobs[0].id).state == "queued"
        r.hset(Keys(NS, "q").config, SHARDS_FIELD, 3)          # resharded without draining
        stale = old.status(jobs[1].id)                          # the old client's keys: 1 shard
        assert stale.state == "stranded" and "registered with 3 shards" in stale.message
    with Client(redis_server.url, namespace=NS, queue="q") as fresh:   # 3 shards, found by id
        status = fresh.status(jobs[0].id)
        assert (status.state, status.position) == ("stranded", None), status
        assert [s.state for s in fresh.statuses([j.id for j in jobs])] == ["stranded"] * 5
        fresh.submit("in layout", job_id="ok")
        assert fresh.status("ok").state == "queued"
    with Client(redis_server.url, namespace=NS, queue="q2") as other:
        other.submit_many(["a", "b"], max_tokens=2)              # no worker yet: no group

    three = Keys(NS, "q", 3)
    expected = sorted([(Keys(NS, "q").lane("default"), 5, OUTSIDE_LAYOUT),  # nobody reads it
                       (three.lane("default", three.shard_of("ok")), 1, NO_GROUP)])  # not yet
    assert [(u.key, u.depth, u.reason) for u in unread_lanes(r, three)] == expected
    assert sdk_main(["stats", "--json", *url]) == 0
    by_queue = {q["queue"]: q for q in json.loads(capsys.readouterr().out)}
    assert [(u["key"], u["depth"], u["reason"])
            for u in by_queue["q"]["unread_lanes"]] == expected
    assert [(u["depth"], u["reason"]) for u in by_queue["q2"]["unread_lanes"]] == [
        (2, NO_GROUP)]
    assert sdk_main(["stats", *url]) == 0
    table = capsys.readouterr().out
    assert f"UNREAD q: {Keys(NS, 'q').lane('default')} holds 5 job(s)" in table
    assert admin.main([*url, "--queue", "q", "--json", "unread"]) == 0
    rows = {row["reason"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[OUTSIDE_LAYOUT]["depth"] == 5 and "3 shards" in rows[OUTSIDE_LAYOUT]["detail"]
    assert rows[NO_GROUP]["depth"] == 1
    r.close()


def test_a_worker_starting_on_a_queue_with_unread_lanes_warns(redis_server, worker_process):
    with Client(redis_server.url, namespace=NS, queue="q") as old:
        old.submit_many(["a", "b"], max_tokens=2)
    r = redis_server.client()
    r.hset(Keys(NS, "q").config, SHARDS_FIELD, 3)
    r.close()
    wp = worker_process("--model", "fake:", "--device", "cpu", "--redis-url", redis_server.url,
                        "--worker-id", "w1", "--namespace", NS, "--queue", "q")
    wp.wait_for_log('"worker ready"', 60)
    (line,) = [json.loads(x) for x in wp.log().splitlines()
               if "jobs in a lane no worker reads" in x]
    assert (line["lane"], line["depth"]) == (Keys(NS, "q").lane("default"), 2)
