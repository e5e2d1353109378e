"""``python -m tests.fault_worker [worker flags]``: ``tokenrelay worker`` for tests, with the
engine factory wrapped by fault injection (TOKENRELAY_FAULT_INJECT) and the outbox's fault
point set from TOKENRELAY_FAULT_POINT (a SIGKILL at a point of a flush); see
tests/fault_harness.py.

Fault injection is a test aid, so it lives here and not on the worker's production path."""

from __future__ import annotations

import sys

from tests.fault_harness import fault_point_from_env, maybe_inject_faults
from tokenrelay.worker.__main__ import main
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.engine_api import EngineAPI, load_engine


def injected_engine(settings: WorkerSettings) -> EngineAPI:
    return maybe_inject_faults(load_engine(settings))


if __name__ == "__main__":
    sys.exit(main(engine_factory=injected_engine, fault_point=fault_point_from_env()))
