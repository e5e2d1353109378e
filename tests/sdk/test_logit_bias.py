"""``logit_bias`` on the producer side (issue #40): ``submit`` carries it in ``params`` with
OpenAI's string keys (any msgpack reader reads them), refuses a bad map before sending, naming
the field, and the fake engine checks the ids as the real engine does."""

from __future__ import annotations

import msgpack
import pytest

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.producer_sdk import InvalidRequest
from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import decode_job
from tokenrelay.worker.fake_engine import FAKE_VOCAB_SIZE, FakeEngine

pytestmark = pytest.mark.timeout(60)


def test_submit_sends_string_keys_and_the_worker_reads_token_ids():
    sent = PayloadBuilder(Keys()).build("hi", logit_bias={"17": 100, 3: -5.5}, max_tokens=2)
    params = msgpack.unpackb(sent.payload, raw=False)["params"]    # strict map keys: strings
    assert params["logit_bias"] == {"17": 100.0, "3": -5.5}
    assert decode_job(sent.payload).sampling_params().logit_bias == {17: 100.0, 3: -5.5}


@pytest.mark.parametrize("bias", [{"17": 250}, {"x": 1}, {"17": None}, "17"])
def test_a_bad_map_is_refused_before_sending(bias):
    with pytest.raises(InvalidRequest) as exc:
        PayloadBuilder(Keys()).build("hi", logit_bias=bias)
    assert exc.value.field == "logit_bias"


def test_the_fake_engine_checks_ids_against_its_vocabulary():
    engine = FakeEngine()
    with pytest.raises(InvalidRequestError, match=f"logit_bias: token id {FAKE_VOCAB_SIZE} is "
                                                  "outside the vocabulary"):
        engine.add_request("r1", "hi", SamplingParams(logit_bias={FAKE_VOCAB_SIZE: 1}))
    engine.add_request("r2", "hi", SamplingParams(logit_bias={ord("z"): 100}, max_tokens=2))
    assert engine.added == ["r2"]
