"""Shared fixtures: the session's distributed worker pools."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dist_pool import PoolSet


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolSet]:
    """``pools.run(world, fn, *args)`` runs ``fn(ctx, *args)`` on ``world`` gloo ranks."""
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()
