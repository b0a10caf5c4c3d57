from __future__ import annotations

import pytest
from bare_helpers import Api


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest) -> Api:
    return Api(request.param)
