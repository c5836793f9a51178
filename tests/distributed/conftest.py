"""Session-wide cache of the subprocess training runs that several distributed test files compare."""

from __future__ import annotations

import pytest

from tests.distributed._launch import RunCache


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"))
