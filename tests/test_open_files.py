"""The daemon lifts its soft open-file limit to the hard one, as Go programs (kube-proxy) do."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
from nfproxy.daemon.open_files import raise_open_file_limit
print(raise_open_file_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE), hard)
"""


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    now, soft, hard, was_hard = map(int, out.split())
    assert was_hard > 64, "this test needs a hard limit above 64"
    assert now == soft == hard == was_hard


def test_a_soft_limit_at_the_hard_one_is_left_alone() -> None:
    import resource

    from nfproxy.daemon.open_files import raise_open_file_limit

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    if before[0] == before[1]:
        assert raise_open_file_limit() == before[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == before
    else:  # not ours to raise in the test process: ask a child with soft == hard
        probe = "import resource; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (h, h)); from nfproxy.daemon.open_files import raise_open_file_limit; print(raise_open_file_limit() == h)"
        assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "True"
