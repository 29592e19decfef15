"""Shared helpers. The suite runs against the INSTALLED wheel (scripts/test-python
installs it into a venv); `test_installed_wheel` checks that `oncely` is not imported
from the source tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "tests" / "vectors"


def load_vectors(name: str) -> list[dict[str, Any]]:
    cases = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    assert isinstance(cases, list) and cases, f"{name} holds no cases"
    return cases


def case_id(case: dict[str, Any]) -> str:
    return str(case.get("comment", ""))[:60] or json.dumps(case)[:60]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
