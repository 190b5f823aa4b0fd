"""The suite's peak-RSS sampler (tests/conftest.py) counts each process once."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import tree_rss


def test_a_fork_that_has_not_exec_d_is_not_counted_again_but_a_subprocess_is():
    read_end, write_end = os.pipe()
    forked = os.fork()
    if forked == 0:  # the child: the parent's pages, its command line; waits, then leaves
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        counted = tree_rss(os.getpid())
        assert forked not in counted
        assert child.pid in counted and counted[child.pid] > 0
        assert counted[os.getpid()] > 0
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(forked, 0)
        child.communicate()
