"""klog-format logs: the text and JSON shapes kube-proxy writes, and its verbosity levels."""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections.abc import Iterator

import pytest

from nfproxy.daemon import logs

LOG = logging.getLogger("nfproxy.test.logs")
# Lmmdd hh:mm:ss.uuuuuu PID file:line] "message" key=value ...
KLOG = re.compile(r'^([IWEF])(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) +(\d+) ([\w.]+):(\d+)\] ("(?:[^"\\]|\\.)*")(.*)$')


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    yield stream
    for h in [h for h in root.handlers if isinstance(h, logs._Handler)]:
        root.removeHandler(h)
    root.setLevel(level)
    logs._verbosity = 0


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_text_lines_are_klog_lines(out: io.StringIO) -> None:
    logs.configure(2, "text", out)
    logs.info(LOG, "Syncing nftables rules", level=2, ipFamily="IPv4", kind="partial",
              servicesChanged=1, endpointsChanged=0, operations=12, elapsed=logs.Duration(0.0034))
    (line,) = lines(out)
    m = KLOG.match(line)
    assert m, line
    assert m.group(1) == "I" and int(m.group(4)) == os.getpid()
    assert m.group(5) == "test_logs.py"  # the caller, not logs.py
    assert m.group(7) == '"Syncing nftables rules"'
    assert m.group(8) == (' ipFamily="IPv4" kind="partial" servicesChanged=1 endpointsChanged=0'
                          ' operations=12 elapsed="3.4ms"')


def test_values_are_logfmt_clean(out: io.StringIO) -> None:
    logs.configure(0, "text", out)
    logs.error(LOG, "Sync failed", ValueError("bad 'x'\tvalue"), ok=True, none=None, ratio=0.5)
    logs.warning(LOG, 'say "hi"', path="/a b")
    err, warn = lines(out)
    assert err.startswith("E") and err.endswith(
        '] "Sync failed" err="bad \'x\'\\tvalue" ok=true none=<nil> ratio=0.5'
    )
    assert warn.startswith("W") and warn.endswith('] "say \\"hi\\"" path="/a b"')


def test_multi_line_values_are_klog_blocks(out: io.StringIO) -> None:
    logs.configure(9, "text", out)
    logs.info(LOG, "Writing nftables rules", level=9, rules="add table ip nfproxy\nflush table ip nfproxy\n")
    text = out.getvalue()
    assert text.endswith('] "Writing nftables rules" rules=<\n\tadd table ip nfproxy\n\tflush table ip nfproxy\n >\n')


def test_plain_logging_calls_come_out_as_klog_lines_too(out: io.StringIO) -> None:
    logs.configure(4, "text", out)
    LOG.info("plain %s", "text")
    LOG.debug("detail")
    try:
        raise KeyError("k")
    except KeyError:
        LOG.exception("it broke")
    plain, debug, broken = lines(out)  # no traceback lines: one line each
    assert KLOG.match(plain) and plain.endswith('] "plain text"')
    assert KLOG.match(debug) and debug.endswith('] "detail"')
    assert broken.startswith("E") and broken.endswith('] "it broke" err="\'k\'"')


def test_verbosity_is_klogs(out: io.StringIO) -> None:
    logs.configure(0, "text", out)
    logs.info(LOG, "at v0")
    logs.info(LOG, "at v2", level=2)
    LOG.debug("python debug is v4")
    logs.warning(LOG, "warnings always")
    assert [KLOG.match(l).group(7) for l in lines(out)] == ['"at v0"', '"warnings always"']
    assert not logs.enabled(9)
    logs.configure(2, "text", out)
    logs.info(LOG, "at v2 now", level=2)
    logs.info(LOG, "at v9", level=9)
    assert lines(out)[-1].endswith('"at v2 now"')
    logs.configure(9, "text", out)
    assert logs.enabled(9)


def test_json_lines_are_kube_proxys_shape(out: io.StringIO) -> None:
    logs.configure(2, "json", out)
    logs.info(LOG, "Syncing iptables rules", level=2, ipFamily="IPv6", operations=3,
              elapsed=logs.Duration(1.5))
    logs.error(LOG, "Healthz server failed", OSError(98, "Address already in use"), address="0.0.0.0:10256")
    first, second = (json.loads(l) for l in lines(out))
    assert set(first) == {"ts", "caller", "msg", "v", "ipFamily", "operations", "elapsed"}
    assert first["msg"] == "Syncing iptables rules" and first["v"] == 2
    assert first["ipFamily"] == "IPv6" and first["operations"] == 3 and first["elapsed"] == "1.5s"
    assert isinstance(first["ts"], float) and first["caller"].startswith("test_logs.py:")
    assert "v" not in second and second["err"] == "[Errno 98] Address already in use"


def test_configure_replaces_itself_and_checks_its_arguments(out: io.StringIO) -> None:
    logs.configure(0, "text", out)
    logs.configure(0, "text", out)
    assert sum(isinstance(h, logs._Handler) for h in logging.getLogger().handlers) == 1
    with pytest.raises(ValueError, match="--logging-format: 'xml'"):
        logs.configure(0, "xml")
    with pytest.raises(ValueError, match="--v: -1"):
        logs.configure(-1, "text")


def test_structured_calls_read_well_in_other_formatters(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOG.name):
        logs.info(LOG, "Serving", server="healthz", address="127.0.0.1:10256")
    assert caplog.records[0].getMessage() == 'Serving server="healthz" address="127.0.0.1:10256"'


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0000005, "500ns"), (0.0012345, "1.2345ms"), (0.25, "250ms"), (1.5, "1.5s"),
     (61, "1m1s"), (3600, "1h0m0s"), (5400.5, "1h30m0.5s"), (0.000002, "2µs")],
)
def test_durations_print_as_go_does(seconds: float, text: str) -> None:
    assert logs.go_duration(seconds) == text
