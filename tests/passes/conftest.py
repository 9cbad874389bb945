"""The graph most pass tests rewrite: the tiny Llama (tests/tiny_models) captured once per
module, as the compiler captures it. Files that test another model define their own `graph`."""

from __future__ import annotations

import pytest

from pass_kit import capture_graph


@pytest.fixture(scope="module")
def graph():
    return capture_graph("llama")
