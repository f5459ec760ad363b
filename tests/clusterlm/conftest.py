"""Session fixtures of the data/demo/model tests: one demo build per test session, in a temporary home.

``CLUSTERLM_HOME`` points at a session temporary directory while these fixtures are in use, so nothing is
written to ``~/.cache/clusterlm`` and the default-root code path (no ``root`` argument) is what builds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The demo data set built through the default root (``$CLUSTERLM_HOME/demo-v1``)."""
    from clusterlm.demo import demo_data

    home = tmp_path_factory.mktemp("clusterlm_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLUSTERLM_HOME", str(home))
        yield demo_data(verbose=False)


@pytest.fixture(scope="session")
def demo_tokenizer(demo: Any) -> Any:
    """The demo tokenizer (``PreTrainedTokenizerFast``)."""
    return demo.load_tokenizer()
