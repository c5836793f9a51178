"""Session-wide cache of the subprocess training runs that several distributed test files compare."""

from __future__ import annotations

import pytest

from tests.distributed._launch import RunCache
from tests.distributed._layouts import LayoutRuns


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    """Every layout of ``_layouts.LAYOUTS`` trained once per session (on first use)."""
    return LayoutRuns(tmp_path_factory.mktemp("layouts"))
