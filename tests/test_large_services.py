"""Services with hundreds or thousands of endpoints: exact values shown, sums that scale.

An endpoint at depth i of an iptables cascade gets k / 2^(31 i) in kernel mode, so a 600-endpoint
service has shares of ~5 600 digits: more than Python writes out (4 300), and, added one by one
as Fractions, a gcd of that size per term. These tests pin what `check`, `trace` and `compare`
show for such services (docs/semantics.md "Long fractions"), that `compare` pays no gcd per
endpoint (an operation count, not a clock), and how `compare` treats weighted cascades whose
ten-decimal probabilities cannot be read back exactly (docs/weights.md).
"""

from __future__ import annotations

import json
import math
import random
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import pytest

from nfproxy.analysis import quantize
from nfproxy.analysis.interpret import Outcome
from nfproxy.cli.main import main
from nfproxy.core.model import NodeConfig
from nfproxy.sources import manifests
from nfproxy.verify.compare import KERNEL_TOLERANCE, Agreement, Comparison, compare
from nfproxy.verify.probe import Probe

SERVICE = "default/big:http (tcp)"


def manifest(n: int, weights: bool = False) -> str:
    """One Service (10.96.10.20:80/TCP), one EndpointSlice of n ready endpoints; with `weights`,
    weights spread over 0-1000 (the annotation of docs/weights.md)."""
    addrs = [f"10.{244 + i // 65024}.{(i // 254) % 256}.{i % 254 + 1}" for i in range(n)]
    annotation = ""
    if weights:
        table = json.dumps({a: (i * 37 + 11) % 1001 for i, a in enumerate(addrs)})
        annotation = f"  annotations:\n    nfproxy.io/endpoint-weights: '{table}'\n"
    head = (
        "apiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: default}\n"
        "spec:\n  type: ClusterIP\n  clusterIP: 10.96.10.20\n  clusterIPs: [10.96.10.20]\n  ipFamilies: [IPv4]\n"
        "  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]\n---\n"
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: big-1\n  namespace: default\n"
        f"  labels: {{kubernetes.io/service-name: big}}\n{annotation}addressType: IPv4\n"
        "ports: [{name: http, port: 8080, protocol: TCP}]\nendpoints:\n"
    )
    return head + "".join(f"  - addresses: [{a}]\n    conditions: {{ready: true}}\n" for a in addrs)


def write(tmp_path: Path, n: int, weights: bool = False) -> Path:
    path = tmp_path / f"big{n}{'w' if weights else ''}.yaml"
    path.write_text(manifest(n, weights))
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`nfproxy render --backend iptables` of a 600-endpoint service, as the probe made it."""
    tmp = tmp_path_factory.mktemp("large")
    yaml = write(tmp, 600)
    out = tmp / "big600.ipt"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["render", "--backend", "iptables", str(yaml)]) == 0
    out.write_text(buf.getvalue())
    return out


# ---- quantize: rounding, showing, summing


def _reference(value: Fraction, digits: int) -> Decimal:
    """The same rounding by the decimal module at a generous precision."""
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.rounding = "ROUND_HALF_EVEN"
        with localcontext() as wide:
            wide.prec = 20_000
            exact = Decimal(value.numerator) / Decimal(value.denominator)
        return +exact


def test_rounded_decimal_is_the_correctly_rounded_value() -> None:
    rng = random.Random(7)
    values = [Fraction(1, 3), Fraction(2, 3), Fraction(5, 10**7), Fraction(999_999, 10**6), Fraction(-5, 7)]
    for _ in range(300):
        bits = rng.choice((8, 64, 600, 5000))
        den = rng.getrandbits(bits) + 1
        values.append(Fraction(rng.randrange(den + 1), den))
    for v in values:
        text = quantize.rounded_decimal(v)
        assert Decimal(text) == _reference(v, quantize.ROUNDED_DIGITS), v
        assert "." in text or "E" in text or text == "0"


def test_exact_text_exact_while_short_rounded_beyond_without_raising() -> None:
    short = Fraction(715827883, 2**31)
    assert quantize.exact_text(short) == "715827883/2147483648"
    assert quantize.shown(short) == "715827883/2147483648"
    deep = Fraction(3 * 2**20000 + 1, 2**20003)  # 6 000-digit parts: str() would raise
    text = quantize.exact_text(deep, quantize.JSON_EXACT_DIGITS)
    assert "/" not in text and "." in text and len(text) < 40
    assert abs(Fraction(text) - deep) < Fraction(1, 10**19)
    assert quantize.shown(deep).startswith("≈0.375")
    # JSON keeps exactness further than text.
    mid = Fraction(1, 3**100)  # 48 digits
    assert quantize.shown(mid).startswith("≈") and quantize.exact_text(mid, quantize.JSON_EXACT_DIGITS) == str(mid)


def test_common_denominator_sums_equal_fraction_sums() -> None:
    rng = random.Random(3)
    for _ in range(50):
        values = [Fraction(rng.getrandbits(40), 1 << rng.randrange(1, 400)) for _ in range(20)]
        values += [Fraction(rng.randrange(1, 1000), rng.randrange(1, 1000)) for _ in range(5)]
        rng.shuffle(values)
        nums, den = quantize.common_denominator(values)
        assert [Fraction(n, den) for n in nums] == values
        assert den == math.lcm(*(v.denominator for v in values))
        assert quantize.fsum(values) == sum(values, Fraction(0))
    assert quantize.fsum([]) == 0


def test_ten_decimal_decoding_bound() -> None:
    """Every w/rest with rest up to the bound reads back exactly from its ten decimals; the
    counterexample docs/weights.md names does not."""
    rng = random.Random(11)
    for _ in range(2000):
        rest = rng.randrange(2, quantize.TEN_DECIMAL_EXACT_DENOMINATOR + 1)
        w = rng.randrange(1, rest)
        assert quantize.ten_decimal_exact(w, rest)
        assert quantize.ideal_probability("%0.10f" % (w / rest)) == Fraction(w, rest)
    assert not quantize.ten_decimal_exact(971, 188343)
    assert "%0.10f" % (971 / 188343) == "0.0051554876"
    assert quantize.ideal_probability("0.0051554876") == Fraction(877, 170110)


# ---- check and trace on a 600-endpoint cascade


def test_check_text_and_json_on_600_endpoints(rendered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--from-file", str(rendered)]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("    10.")]
    assert len(lines) == 600 and "no problems found" in text
    assert any("≈0.00166" in line for line in lines)  # deep in the cascade: rounded, marked
    assert any(line.endswith("/2147483648") for line in lines)  # the first rule: exact
    assert max(map(len, text.splitlines())) < 200

    assert main(["check", "--json", "--from-file", str(rendered)]) == 0
    out = json.loads(capsys.readouterr().out)
    (svc,) = out["services"]
    probs = [e["probability"] for e in svc["endpoints"]]
    assert len(probs) == 600
    exact = [p for p in probs if "." not in p]
    rounded = [p for p in probs if "." in p]
    assert exact and rounded  # both forms, told apart by the decimal point
    assert all("/" not in p and "E" not in p for p in rounded)
    # Every value reads back as a Fraction; together they account for the whole chain within
    # the rounding (600 values, each within 1e-22 here).
    total = sum((Fraction(p) for p in probs), Fraction(0))
    assert abs(total - 1) < Fraction(1, 10**18)
    assert svc["fallthrough"] == "0"


def test_trace_text_on_600_endpoints(rendered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--from-file", str(rendered), "203.0.113.5", "10.96.10.20:80/tcp"]) == 0
    text = capsys.readouterr().out
    shown = [line for line in text.splitlines() if "  p = " in line]
    assert len(shown) == 20 and "... and 580 more outcomes" in text
    # Most of the likeliest are deep in the cascade (rounded, marked); a shallow one is exact.
    rounded = [line for line in shown if "p = ≈0.00166" in line]
    assert len(rounded) >= 15
    assert all("/" in line.split("p = ")[1].split(" ≈ ")[0] for line in shown if line not in rounded)
    assert max(map(len, text.splitlines())) < 300


def test_trace_json_on_600_endpoints(rendered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON shows each path's probability exact while short, else as a rounded decimal (it
    raised past Python's 4 300-digit conversion limit)."""
    assert main(["trace", "--json", "--from-file", str(rendered), "203.0.113.5", "10.96.10.20:80/tcp"]) == 0
    answer = json.loads(capsys.readouterr().out)
    values = [p["probability"] for p in answer["paths"]]
    assert len(values) == 600
    assert any("/" in v for v in values) and any("." in v for v in values)
    assert abs(sum(Fraction(v) for v in values) - 1) < Fraction(1, 10**18)


# ---- compare: exact verdicts, sums over one denominator


def _big_gcds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count gcds of numbers over 10 000 bits (what Fraction pays per addition)."""
    calls: list[int] = []
    real = math.gcd

    def gcd(*args: int) -> int:
        if any(a.bit_length() > 10_000 for a in args):
            calls.append(1)
        return real(*args)

    monkeypatch.setattr(math, "gcd", gcd)
    return calls


def test_compare_600_endpoints_costs_no_gcd_per_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = manifests.load(str(write(tmp_path, 600)), NodeConfig()).state
    result = compare(state)
    calls = _big_gcds(monkeypatch)
    assert result.equivalent and result.ideal_exact
    assert 0 < result.max_difference <= KERNEL_TOLERANCE
    assert 0 < result.total_variation < Fraction(1, 10**6)
    for r in result.results:
        r.max_difference, r.total_variation, r.iptables_deviation, r.nft_deviation  # noqa: B018
    # Summing 600 Fractions one by one took >= 600 such gcds per probe; now a few per probe.
    assert len(calls) <= 4 * len(result.results)
    # The figures equal the Fraction arithmetic they replace.
    r = next(r for r in result.results if len(r.iptables) == 600)
    keys = set(r.iptables) | set(r.nft)
    diffs = [abs(r.iptables.get(k, 0) - r.nft.get(k, 0)) for k in keys]
    assert r.max_difference == max(diffs) and r.total_variation == sum(diffs, Fraction(0)) / 2


def test_compare_json_on_600_endpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--json", str(write(tmp_path, 600))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equivalent"] and out["ideal_exact"] and out["ideal_inexact_services"] == []
    dist = next(p["iptables"] for p in out["probes"] if len(p["iptables"]) == 600)
    assert any("." in v for v in dist.values()) and any("/" in v for v in dist.values())
    assert abs(sum(Fraction(v) for v in dist.values()) - 1) < Fraction(1, 10**18)


def test_weighted_400_endpoints_ideal_mode_within_tolerance_not_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """400 endpoints of weights up to 1000: some cascade rules w/rest have reduced denominators
    near 200 000, which ten decimals cannot pin (971/188343 reads back as 877/170110). compare
    used to call that NOT EQUIVALENT; it is equivalent within 1e-9, and says ideal mode is not
    exact for this service."""
    state = manifests.load(str(write(tmp_path, 400, weights=True)), NodeConfig()).state
    result = compare(state)
    assert result.equivalent
    assert result.ideal_inexact_services == [SERVICE]
    walked = [r for r in result.results if r.probe.service == SERVICE]
    assert walked and not any(r.ideal_exact for r in walked)
    assert any(0 < r.ideal_max_difference <= KERNEL_TOLERANCE for r in walked)  # the decoding differs
    assert all(r.max_difference <= KERNEL_TOLERANCE for r in walked)

    assert main(["compare", str(tmp_path / "big400w.yaml")]) == 0
    text = capsys.readouterr().out
    assert f"{SERVICE}  (ideal mode: within 1e-9, not exact" in text
    assert "not exactly, for 1 service(s)" in text and text.rstrip().endswith("EQUIVALENT")


def test_weighted_100_endpoints_ideal_mode_stays_exact(tmp_path: Path) -> None:
    """Up to 100 endpoints of weight <= 1000 every rule reads back exactly: exact equality."""
    state = manifests.load(str(write(tmp_path, 100, weights=True)), NodeConfig()).state
    result = compare(state)
    assert result.equivalent and result.ideal_exact
    walked = [r for r in result.results if r.probe.service == SERVICE and len(r.iptables_ideal) > 1]
    assert walked and all(r.iptables_ideal == r.nft_ideal for r in walked)


def test_inexact_ideal_mode_still_catches_real_differences() -> None:
    probe = Probe("10.0.0.1", "10.96.0.1", 80, "tcp", "pod", service="x", traffic="cluster IP from pod")
    a, b = Outcome("dnat", "10.0.0.2:80"), Outcome("dnat", "10.0.0.3:80")
    kernel = {a: Fraction(1, 2), b: Fraction(1, 2)}
    off = {a: Fraction(1, 2) + Fraction(2, 10**9), b: Fraction(1, 2) - Fraction(2, 10**9)}
    near = {a: Fraction(1, 2) + Fraction(1, 10**10), b: Fraction(1, 2) - Fraction(1, 10**10)}
    assert Agreement(probe, kernel, kernel, kernel, near, ideal_exact=False).equivalent
    assert not Agreement(probe, kernel, kernel, kernel, near).equivalent  # exact where it can be
    assert not Agreement(probe, kernel, kernel, kernel, off, ideal_exact=False).equivalent
    assert not Agreement(probe, kernel, kernel, kernel, {a: Fraction(1)}, ideal_exact=False).equivalent
    r = Agreement(probe, kernel, kernel, kernel, near, ideal_exact=False)
    assert r.ideal_max_difference == Fraction(1, 10**10)
    assert not Comparison((r,)).ideal_exact and Comparison((r,)).ideal_inexact_services == ["x"]
