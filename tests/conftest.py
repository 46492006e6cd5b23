"""Shared fixtures. Kernel tests get a throwaway network namespace, removed even on failure."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "nfproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile("nfproxy")

os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


@pytest.fixture(autouse=True)
def _no_klog_handler_outlives_its_test() -> Iterator[None]:
    """A test that runs the command line in-process configures nfproxy's klog handler on the
    root logger, writing to the sys.stderr of that moment: pytest's capture of that test. Left
    behind, every later log line (a daemon thread's, another test's) goes to a closed capture
    file and prints "--- Logging error ---" tracebacks. Each test starts and ends without one,
    at the default verbosity."""
    import logging

    from nfproxy.daemon import logs

    root = logging.getLogger()
    level, verbosity = root.level, logs._verbosity
    yield
    for handler in [h for h in root.handlers if isinstance(h, logs._Handler)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    logs._verbosity = verbosity


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace; kernel tests fail loudly (never skip) without root."""
    if os.geteuid() != 0:
        pytest.fail("kernel tests need root: they create network namespaces (run scripts/test)")
    from nfproxy.kernel import netns as netns_mod

    with netns_mod.throwaway("nfp-test") as name:
        yield name


class _Blocked(ImportError):
    pass


@pytest.fixture
def imports_of() -> Iterator[object]:
    """Runs code in this process as if nfproxy were imported afresh, and says which top-level
    packages it imported. A fresh interpreter would be the obvious way, but the test user of an
    unprivileged run may not be allowed to start the venv's interpreter again; this is the same
    check without a subprocess: nfproxy's and the watched packages' modules are set aside (so
    module-level imports run again), an import hook records what is imported, and everything is
    put back afterwards."""
    import contextlib
    import importlib.abc
    import sys

    @contextlib.contextmanager
    def watching(*packages: str) -> Iterator[set[str]]:
        seen: set[str] = set()

        class Recorder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN202
                top = name.split(".")[0]
                if top in packages:
                    seen.add(top)
                return None

        def ours(name: str) -> bool:
            return name.split(".")[0] in ("nfproxy", *packages)

        saved = {n: m for n, m in sys.modules.items() if ours(n)}
        for n in saved:
            del sys.modules[n]
        recorder = Recorder()
        sys.meta_path.insert(0, recorder)
        try:
            yield seen
        finally:
            sys.meta_path.remove(recorder)
            for n in [n for n in sys.modules if ours(n)]:
                del sys.modules[n]
            sys.modules.update(saved)

    yield watching


def run_cli_forked(argv: list[str], timeout: float = 60.0) -> tuple[int, str, str]:
    """`nfproxy ARGV` in a forked child: (exit status, stdout, stderr).

    A child process, so that a hang (the bug some tests guard against) is ended by the timeout
    and fails the test instead of blocking it; forked rather than started as a new interpreter,
    because the test user of an unprivileged run may not be allowed to execute the venv's
    interpreter again."""
    import multiprocessing
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        def child() -> None:
            import sys

            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            import logging

            # The parent's handlers (pytest's capture, streams of earlier tests) are not ours:
            # the command configures its own, as a fresh process would.
            for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
                if isinstance(logger, logging.Logger):
                    logger.handlers.clear()
            from nfproxy.cli.main import main

            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            pytest.fail(f"nfproxy {' '.join(argv)}: still running after {timeout} s")
        out.seek(0)
        err.seek(0)
        return int(proc.exitcode or 0), out.read(), err.read()


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP (a CI timeout, a closed terminal) stop the run as Ctrl-C does: by an
    exception, so that every `with` block and fixture of the running test still removes its
    namespaces. Their default action would end the process on the spot and leave them."""
    import signal

    from nfproxy.kernel.netns import Interrupted

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, interrupt)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[object]:
    """The real etcd + kube-apiserver (`scripts/kube up`), one for the session, always taken
    down. A fixed directory, so a run killed before its teardown is cleaned by the next;
    NFPROXY_KUBE_TEST_DIR names another, for a second run beside it (ports are free ones)."""
    import tempfile

    from tests.realkube import ControlPlane

    plane = ControlPlane(os.environ.get("NFPROXY_KUBE_TEST_DIR")
                         or os.path.join(tempfile.gettempdir(), "nfproxy-kube-tests"))
    try:
        yield plane
    finally:
        plane.close()
