"""Model tests run torch single-threaded; the block-kernel tests' `path` (each kernel path,
forced through the environment) and `threads` (torch's thread count restored) fixtures.

These tensors are tiny: a second intra-op thread only adds barrier waits, and on a shared
2-core machine those waits (a spinning thread whose partner is descheduled) made the suite
five times slower. The previous setting is restored after each test.
"""

from collections.abc import Iterator

import pytest
import torch

from meshd.model.kernels.blocks import BLOCK_KERNELS_ENV, PATHS, path_unavailable_reason


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each kernel path, forced through the environment as an operator would."""
    reason = path_unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} does not run on this CPU: {reason}")
    monkeypatch.setenv(BLOCK_KERNELS_ENV, request.param)
    yield request.param


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
