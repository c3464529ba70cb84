"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from servers import server_starter

start_server = pytest.fixture(server_starter)
