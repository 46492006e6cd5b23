"""Kernel-mode probabilities equal the closed forms of the reference §4, for n = 1 … 1000.

The closed forms are computed here from the kernel's formulas, independently of
nfproxy.analysis.quantize (which the interpreter uses), and compared exactly with what the
interpreter derives from the renderers' own rules read back through the parsers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from nfproxy.analysis import iptables_save, nft_json, quantize
from nfproxy.analysis.interpret import Packet, interpret, walk_chain
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.nft import NftSession
from nfproxy.core.model import IPFamily
from nfproxy.testing import uniform_cluster

N_MAX = 1000
TWO31 = 2**31
TWO32 = 2**32


def thresholds(n: int) -> list[int]:
    """§4: rule i prints 1/(n-i) with %0.10f; iptables stores lround(p * 2^31)."""
    return [int(float(f"{1 / (n - i):.10f}") * TWO31 + 0.5) for i in range(n - 1)]


def closed_iptables_scaled(n: int) -> list[int]:
    """Endpoint i gets prod_{j<i}(1 - q_j) q_i, the last the remainder, as numerators over
    2^(31 (n-1)): plain integers, so all 1000 sizes take well under a second."""
    m = n - 1
    out, rest = [], 1
    for i, t in enumerate(thresholds(n)):
        out.append((rest * t) << (31 * (m - 1 - i)))
        rest *= TWO31 - t
    return out + [rest]


def closed_iptables(n: int) -> list[Fraction]:
    return [Fraction(a, 2 ** (31 * (n - 1))) for a in closed_iptables_scaled(n)]


def closed_numgen_counts(n: int) -> list[int]:
    """§4: bucket k of reciprocal_scale holds ceil((k+1) 2^32/n) - ceil(k 2^32/n) values."""
    def ceil(k: int) -> int:
        return -((-k * TWO32) // n)

    return [ceil(k + 1) - ceil(k) for k in range(n)]


def closed_numgen(n: int) -> list[Fraction]:
    return [Fraction(c, TWO32) for c in closed_numgen_counts(n)]


def test_statistic_threshold_round_trip() -> None:
    # The reference's worked example: 0.3333333333 is stored as 715827883 and saved as 0.33333333349.
    assert quantize.iptables_threshold("0.3333333333") == 715827883
    assert quantize.iptables_saved_text(715827883) == "0.33333333349"
    assert quantize.iptables_threshold("0.33333333349") == 715827883
    assert quantize.iptables_probability("1.0000000000") == 1
    assert quantize.ideal_probability("0.33333333349") == Fraction(1, 3)
    assert quantize.ideal_probability("0.3400000000") == Fraction(17, 50)
    with pytest.raises(ValueError):
        quantize.iptables_threshold("1.5")


def test_numgen_buckets_are_floor_or_ceil() -> None:
    for n in (1, 2, 3, 7, 1000, 65537):
        b = quantize.numgen_buckets(n)
        assert sum(b) == TWO32
        assert set(b) <= {TWO32 // n, -(-TWO32 // n)}
        assert sum(1 for c in b if c != TWO32 // n) == TWO32 % n


def closed_iptables_fixed(n: int, bits: int) -> list[int]:
    """The same shares in `bits`-bit fixed point, each truncated: share i is below the exact
    value by at most i+1 units of 2^-bits (each step truncates once)."""
    out, rest = [], 1 << bits
    for t in thresholds(n):
        out.append(rest * t >> 31)
        rest = rest * (TWO31 - t) >> 31
    return out + [rest]


def test_closed_forms_and_backend_gap_for_every_n() -> None:
    """For every n in 1..1000: the kernel's stored thresholds and numgen buckets equal the closed
    forms exactly (quantize computes them), the numgen shares sum to exactly 1, and the two
    backends' shares differ by less than 1e-9 per endpoint. The difference is bounded with
    96-bit fixed point (error below n * 2^-96, far under the 1e-9 being tested)."""
    bits = 96
    worst = 0
    for n in range(1, N_MAX + 1):
        b = closed_numgen_counts(n)
        assert sum(b) == TWO32, n
        assert list(quantize.numgen_buckets(n)) == b, n
        assert [quantize.iptables_threshold(f"{1 / (n - i):.10f}") for i in range(n - 1)] == thresholds(n), n
        shares = closed_iptables_fixed(n, bits)
        assert (1 << bits) - n <= sum(shares) <= 1 << bits, n  # sums to 1, up to truncation
        gap = max(abs(x - (c << (bits - 32))) for x, c in zip(shares, b))
        assert (gap + n) * 10**9 < (1 << bits), n
        worst = max(worst, gap)
    assert worst > 0  # the two kernels really do differ; "uniform" is not exact
    # quantize.cascade (Fractions) agrees with the closed form where numbers stay small.
    for n in range(1, 60):
        qs = [quantize.iptables_probability(f"{1 / (n - i):.10f}") for i in range(n - 1)]
        assert quantize.cascade(qs) == closed_iptables(n)


# Sizes pushed through render -> parse -> interpret (the closed forms cover every n above; the
# pipeline costs ~O(n^2) big-integer work per size, so a spread keeps this test to seconds).
PIPELINE_SIZES = list(range(1, 101)) + [127, 128, 255, 256, 333, 500, 999, 1000]


def sized_cluster(sizes: list[int]):  # noqa: ANN201
    """One ClusterIP service per size n, with n endpoints (names and addresses unique)."""
    from nfproxy.core.model import ClusterState, Endpoint, Protocol, ServicePort, ServicePortName, ServiceType
    from nfproxy.testing import NODE

    services, endpoints = {}, {}
    for n in sizes:
        spn = ServicePortName("ns", f"svc-{n}", "", Protocol.TCP)
        svc = ServicePort(spn, IPFamily.V4, ServiceType.CLUSTER_IP, f"172.30.{n >> 8}.{n & 255}", 80)
        services[svc.key] = svc
        endpoints[svc.key] = tuple(sorted(
            (Endpoint(f"10.{n >> 8}.{n & 255}.{j >> 8}", 1000 + (j & 255), node_name="node-b") for j in range(n)),
            key=lambda e: e.address,
        ))
    return ClusterState(NODE, services, endpoints)


def test_iptables_rules_read_back_match_closed_form() -> None:
    """Rendered cascades read back and walked exactly equal the closed form."""
    state = sized_cluster(PIPELINE_SIZES)
    services, endpoints = state.services, state.endpoints
    rules = iptables_backend.render(state, IPFamily.V4)
    for key, svc in services.items():
        n = len(endpoints[key])
        chain = rules.service_chains[key]
        text = "*nat\n" + "".join(f":{c} - [0:0]\n" for c in chain.chains) + "\n".join(chain.rules) + "\nCOMMIT\n"
        rs = iptables_save.parse(text, IPFamily.V4)
        (table,) = rs.tables
        svc_chain = next(c for c in chain.chains if c.startswith("KUBE-SVC-"))
        paths = walk_chain(rs, table, svc_chain, Packet("10.0.0.5", svc.cluster_ip, 80, "tcp", "pod"))
        got = {}
        for p in paths:
            got[p.outcome.endpoint] = got.get(p.outcome.endpoint, 0) + p.probability
        m = n - 1
        expected = dict(zip((e.address for e in endpoints[key]), closed_iptables_scaled(n)))
        assert set(got) == set(expected), n
        for addr, p in got.items():
            assert p.numerator << (31 * m) == expected[addr] * p.denominator, (n, addr)


NFT_SIZES = list(range(1, 65)) + [100, 255, 256, 333, 999, 1000]


@pytest.mark.kernel
def test_nft_rules_read_back_match_closed_form(netns: str) -> None:
    """numgen through the kernel: applied, listed with -j, parsed, walked (a spread of sizes:
    every n up to 1000 would mean half a million slots)."""
    state = sized_cluster(NFT_SIZES)
    session = NftSession(netns)
    session.apply(nft_backend.render(state, IPFamily.V4).script())
    _assert_closed_form(state, nft_json.parse(session.list_table("ip", "nfproxy")))


def test_nft_rules_in_memory_match_closed_form() -> None:
    """The same through the in-memory kernel's JSON (no root)."""
    state = sized_cluster(NFT_SIZES)
    kernel = MemoryNft(IPFamily.V4)
    kernel.apply(nft_backend.render(state, IPFamily.V4).transactions())
    _assert_closed_form(state, nft_json.parse(kernel.json()))


def _assert_closed_form(state, rs) -> None:  # noqa: ANN001
    services, endpoints = state.services, state.endpoints
    for key, svc in services.items():
        n = len(endpoints[key])
        dist = interpret(rs, Packet("10.0.0.5", svc.cluster_ip, 80, "tcp", "pod"), node_ips=state.node.ips)
        expected = {e.address: p for e, p in zip(endpoints[key], closed_numgen(n))}
        assert {o.endpoint: p for o, p in dist.items()} == expected, n
        ideal = interpret(rs, Packet("10.0.0.5", svc.cluster_ip, 80, "tcp", "pod"), node_ips=state.node.ips, mode="ideal")
        assert set(ideal.values()) == {Fraction(1, n)}


def test_ideal_mode_recovers_every_one_over_k() -> None:
    """Ideal mode reads both kube-proxy's 10 digits and iptables-save's 11 as exactly 1/k."""
    for k in range(1, 5001):
        written = f"{1 / k:.10f}"
        saved = quantize.iptables_saved_text(quantize.iptables_threshold(written))
        assert quantize.ideal_probability(written) == quantize.ideal_probability(saved) == Fraction(1, k), k
