"""The fault tests' shared fixture: ``env``, a private redis-server with the fault harness
(tests/fault_harness.py), every worker it started killed and the server stopped at the end, also
when the test fails."""

from __future__ import annotations

import pytest

from tests.fault_harness import FaultEnv


@pytest.fixture
def env(request, tmp_path) -> FaultEnv:
    e = FaultEnv(tmp_path)
    request.addfinalizer(e.close)
    return e
