"""ExecutorConfig checks, and the lower priority of the executor's background threads."""

from __future__ import annotations

import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from dynarl.migrate import ExecutorConfig
from dynarl.migrate._executor import _lower_priority


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_bytes": 4}, {"direct_bytes": 0}, {"warmup_bytes": -1}, {"background_nice": 20}],
)
def test_bad_config_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ExecutorConfig(**kwargs)


@pytest.mark.skipif(sys.platform != "linux", reason="thread niceness is per thread on Linux")
def test_background_threads_are_reniced_and_the_caller_is_not() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    renice = functools.partial(_lower_priority, 3)
    with ThreadPoolExecutor(1, initializer=renice) as pool:
        inside = pool.submit(os.getpriority, os.PRIO_PROCESS, 0).result()
    assert inside == min(19, before + 3)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
