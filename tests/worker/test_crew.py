"""worker/crew.py: each collaborator of the loop gets what it uses, typed, and the ones it calls
are the crew's own (so admission's rejections land on the outbox the loop flushes); none holds
the worker itself."""

from __future__ import annotations

import inspect
import typing

import pytest

from tests.import_boundaries import ROOT
from tests.worker.hand_driven import hand_worker  # noqa: F401
from tokenrelay.worker.admission import Admission
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.crew import Crew
from tokenrelay.worker.drain import Drain
from tokenrelay.worker.intake import Intake
from tokenrelay.worker.liveness import Liveness
from tokenrelay.worker.outbox import Outbox
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.service import Worker
from tokenrelay.worker.steps import Stepper

pytestmark = pytest.mark.timeout(60)
COLLABORATORS = (Admission, Affinity, Drain, Intake, Liveness, Outbox, Stepper)


def test_collaborators_share_the_crews_instances(hand_worker):
    c = hand_worker()._crew()
    assert c.admission.outbox is c.outbox and c.stepper.outbox is c.outbox
    assert c.drain.outbox is c.outbox and c.drain.intake is c.intake
    assert c.intake.affinity is c.affinity and c.drain.affinity is c.affinity
    assert c.liveness.affinity is c.affinity
    for part in (c.admission, c.stepper, c.drain, c.intake, c.affinity, c.liveness, c.outbox):
        assert part.pending is c.pending
    assert c.admission.jobs is c.outbox.jobs is c.stepper.jobs is c.drain.jobs


@pytest.mark.parametrize("cls", COLLABORATORS, ids=lambda c: c.__name__)
def test_no_collaborator_takes_the_worker_or_an_untyped_handle(cls):
    hints = typing.get_type_hints(cls.__init__)
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert set(params) <= set(hints), f"{cls.__name__}: untyped parameters"
    assert "worker" not in params and Worker not in hints.values()
    crewmates = {Admission, Affinity, Drain, Intake, Liveness, Outbox, Stepper, PendingList}
    for name, hint in hints.items():
        if name in {c.__name__.lower() for c in crewmates} | {"pending"}:
            assert hint in crewmates, f"{cls.__name__}.{name} is typed {hint}"


def test_admission_reaches_the_outbox_through_a_typed_attribute():
    assert typing.get_type_hints(Admission.__init__)["outbox"] is Outbox
    assert typing.get_type_hints(Stepper.__init__)["outbox"] is Outbox
    assert {f.name for f in Crew.__dataclass_fields__.values()} == {
        "pending", "affinity", "intake", "outbox", "admission", "stepper", "drain", "liveness"}


def test_no_module_of_the_worker_keeps_a_handle_to_everything():
    """In addition to the tests above: the old hub pattern does not come back by hand."""
    for path in sorted((ROOT / "worker").glob("*.py")):
        text = path.read_text()
        assert "worker: Any" not in text and "self.w." not in text, path.name
