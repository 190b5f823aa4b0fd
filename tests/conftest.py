"""Suite-wide fixtures, and the suite's peak memory, printed at the end of every run.

Peak RSS: a sampler thread sums the resident memory (``VmRSS``) of the test process and
every live descendant (stage processes, CLI subprocesses, browsers) every 50 ms; the
report prints that sampled peak next to the exact high-water marks the kernel keeps (the
test process's ``VmHWM``, the largest waited-for child's ``ru_maxrss``). A run whose
peak exceeds :data:`PEAK_RSS_LIMIT_BYTES` fails (issue 13: a suite at 10-12 GB got a run
OOM-killed on a 24 GB machine shared by several engineers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
import threading
from pathlib import Path

import pytest

PEAK_RSS_LIMIT_BYTES = 4 * 1024**3
SAMPLE_PERIOD_S = 0.05

#: Per-process caches that hold loaded weights (``module: function``), emptied after every
#: test module: a model that a module's server or pipeline loaded is not kept for the rest
#: of the session (a later module that needs it loads it again). A cache absent from the
#: installed version is skipped.
MODEL_CACHES = (
    ("omnistage.models.qwen3_omni.stages", "loaded_model"),
    ("omnistage.models.qwen3_tts.stages", "loaded_checkpoint"),
    # FastAPI (0.165) classifies each route's endpoint once in module-level lru_caches that
    # keep the endpoint, so every app a module served stayed alive through its closures:
    # server, pipeline, engines, KV pools. Measured: +270 MiB kept per module that served
    # the tiny Qwen3-Omni (its thinker's 256 MiB KV pool), the suite's test process at 3 GB.
    ("fastapi.dependencies.models", "_is_gen_callable_cached"),
    ("fastapi.dependencies.models", "_is_async_gen_callable_cached"),
    ("fastapi.dependencies.models", "_is_coroutine_callable_cached"),
)
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def free_memory() -> None:
    """Drop the :data:`MODEL_CACHES`, collect, and give the freed heap back to the kernel
    (glibc ``malloc_trim``; without it the test process keeps every module's high-water
    mark, and each stage or soak subprocess it starts adds to that)."""
    for module, function in MODEL_CACHES:
        cached = getattr(sys.modules.get(module), function, None)
        if cached is not None:
            cached.cache_clear()
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _status_kib(pid: int, key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status`` in KiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(k) for k in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def tree_rss(root: int) -> dict[int, int]:
    """Resident bytes of ``root`` and of each of its live descendants now, by pid.

    A descendant that still runs ``root``'s own command line is a fork of it that has not
    exec'd yet (``subprocess`` forks, or vforks, then execs; nothing in the suite forks
    without exec): it shares ``root``'s pages (vfork: its very address space), so counting
    its VmRSS would count ``root`` twice. Measured: a decode-worker spawn caught in that
    window put a 2.1 GB suite at 4147 MiB. Its descendants are counted as usual.
    """
    own = _cmdline(root)
    rss, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid == root or _cmdline(pid) != own:
            rss[pid] = _status_kib(pid, "VmRSS") * 1024
        todo += _children(pid)
    return rss


def _program(pid: int) -> str:
    return _cmdline(pid).replace(b"\0", b" ").decode(errors="replace")[-60:].strip() or "?"


class PeakRSS:
    """Samples :func:`tree_rss` of this process until :meth:`stop`; at the peak it keeps
    the test that was running and the largest processes (``where``)."""

    def __init__(self) -> None:
        self.peak = 0
        self.test = ""  # the running test's node id (set by pytest_runtest_protocol)
        self.where = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            rss = tree_rss(pid)
            if sum(rss.values()) > self.peak:
                self.peak = sum(rss.values())
                largest = sorted(rss.items(), key=lambda item: -item[1])[:4]
                shown = ", ".join(f"{_program(p) if p != pid else 'pytest'}: {b / 1024**2:.0f}" for p, b in largest)
                self.where = f"during {self.test or 'collection'} (MiB: {shown})"
            if self._stop.wait(SAMPLE_PERIOD_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_peak: PeakRSS | None = None


#: Test files whose subprocesses are large: they run first, while the test process is small
#: (it grows to ~2.4 GB over the suite's modules), so their subprocesses do not add to its
#: high-water mark. The soak test runs the server and a load driver: run last, it peaked the
#: suite at 4105 MiB (pytest 2381 + soak driver 1120 + engine 420 MiB). The Ray placement
#: tests run a two-node Ray cluster and up to five stage actors: ~2.2 GB besides pytest.
RUN_FIRST = ("test_soak.py", "test_ray_placement.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in RUN_FIRST)  # stable: keeps the rest's order


def pytest_sessionstart(session: pytest.Session) -> None:
    global _peak
    _peak = PeakRSS()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Names the running test for the peak report; after a test module's last test,
    :func:`free_memory`. Here, not in a module fixture's teardown: until its protocol
    ends, pytest keeps the last test's fixture values (``item.funcargs``, e.g. a module's
    pipeline or server), so a collection in the teardown freed nothing of them."""
    if _peak is not None:
        _peak.test = item.nodeid
    yield
    if nextitem is None or nextitem.path != item.path:
        free_memory()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _peak is None:
        return
    _peak.stop()
    if _peak.peak > PEAK_RSS_LIMIT_BYTES and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _peak is None:
        return
    mib = 1024**2
    own = _status_kib(os.getpid(), "VmHWM") * 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    verdict = "over" if _peak.peak > PEAK_RSS_LIMIT_BYTES else "within"
    terminalreporter.write_line(
        f"peak RSS: {_peak.peak / mib:.0f} MiB (test process + descendants, sampled every "
        f"{SAMPLE_PERIOD_S * 1000:.0f} ms; {verdict} the {PEAK_RSS_LIMIT_BYTES / mib:.0f} MiB limit); "
        f"test process high-water mark {own / mib:.0f} MiB; largest child {child / mib:.0f} MiB"
    )
    terminalreporter.write_line(f"peak RSS reached {_peak.where}")
