"""`vllm-gateway check-config` (a subprocess) accepts the example configuration.
The example's coverage of every setting: tests/unit/config/test_settings.py."""

from __future__ import annotations

import json

import pytest

from tests.procs import clean_env as child_env
from tests.procs import run_cli
from tests.unit.config.test_settings import EXAMPLE


@pytest.mark.slow
def test_check_config_accepts_the_example_configuration() -> None:
    result = run_cli("check-config", "--config", str(EXAMPLE), env=child_env())
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["engines"] == ["http://127.0.0.1:8001"]
    assert data["payload"]["cache_isolation"] == "off"
