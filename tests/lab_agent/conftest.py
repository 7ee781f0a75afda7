"""Tests run by scripts/agent-lab (a libvirtd of their own, on this host, and the agent guest); skipped elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs scripts/agent-lab (scripts/lab-tests runs it)")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.lab)
            if os.environ.get("AGENT_LAB") != "1":
                item.add_marker(skip)
