"""A job's ``producer`` travels from the SDK through Redis to the engine's ``owner`` (the unit
its grammar compiles are shared fairly among, issue #42), and only valid ids get that far."""

from __future__ import annotations

import msgpack
import pytest
import redis

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.errors import InvalidRequest
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import MAX_PRODUCER_LEN, decode_job
from tokenrelay.worker.fake_engine import FakeEngine
from tests.fault_harness import submit, wait_for_terminal

pytestmark = pytest.mark.timeout(60)
GREEDY = {"max_tokens": 2, "temperature": 0}


def test_the_producer_reaches_the_engine_as_owner(start_worker, redis_server):
    fake = FakeEngine()
    start_worker(engine=fake)
    with Client(redis_server.url, producer="team-a") as client:
        default = client.submit("hi", **GREEDY)
        named = client.submit("hi", producer="team-b", **GREEDY)
        bulk = client.submit_many(["x", {"prompt": "y", "producer": "team-c"}], **GREEDY)
        for job in (default, named, *bulk):
            job.result(timeout=20)
    r = redis.Redis.from_url(redis_server.url)
    submit(r, Keys(), {"job_id": "raw-1", "prompt": "hi", "params": GREEDY})
    wait_for_terminal(r, Keys(), "raw-1")
    assert [fake.owners[j.id] for j in (default, named, *bulk)] == \
        ["team-a", "team-b", "team-a", "team-c"]
    assert fake.owners["raw-1"] is None
    r.close()


@pytest.mark.parametrize("bad", ["", "two words", "x" * (MAX_PRODUCER_LEN + 1), "tab\there", 7])
def test_a_bad_producer_is_refused_by_the_sdk_and_by_the_worker(bad):
    with pytest.raises(InvalidRequest, match="producer"):
        Client("redis://127.0.0.1:1", queue="nowhere").prepare("hi", producer=bad)
    raw = msgpack.packb({"v": 1, "job_id": "j", "prompt": "hi", "producer": bad})
    with pytest.raises(ProtocolError) as err:
        decode_job(raw)
    assert err.value.field == "producer"


def test_a_client_with_a_bad_default_producer_does_not_start():
    with pytest.raises(ValueError, match="producer"):
        Client("redis://127.0.0.1:1", producer="has space")


def test_the_clis_producer_flag_reaches_the_engine(start_worker, redis_server, capsys):
    from tokenrelay.producer_sdk.cli.main import main
    fake = FakeEngine()
    start_worker(engine=fake)
    assert main(["--redis-url", redis_server.url, "submit", "--producer", "cli-team",
                 "--max-tokens", "2", "--timeout", "20", "hi"]) == 0
    job_id = capsys.readouterr().err.split("job ", 1)[1].split()[0]
    assert fake.owners[job_id] == "cli-team"
