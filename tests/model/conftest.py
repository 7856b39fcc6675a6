"""Model tests run torch single-threaded.

These tensors are tiny: a second intra-op thread only adds barrier waits, and on a shared
2-core machine those waits (a spinning thread whose partner is descheduled) made the suite
five times slower. The previous setting is restored after each test.
"""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
