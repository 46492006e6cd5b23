"""Kernel acceptance: every rendered ruleset is applied for real and read back.

The expected numbers of chains, sets and elements come from the model and categorisation
(kube-proxy's rules for which chains exist), never from the rendered text, and are compared
with what `iptables-save` / `nft -j list table` print from the kernel.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from nfproxy.analysis.inventory import from_iptables_save, from_nft_json
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.categorize import categorize
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.sources import manifests
from nfproxy.testing import random_cluster, uniform_cluster

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.kernel


def expected_chains(state: ClusterState, family: IPFamily) -> dict[str, Counter[str]]:
    ipt: Counter[str] = Counter()
    nft: Counter[str] = Counter()
    for svc, eps in state.service_ports(family):
        r = categorize(svc, eps, state.node)
        for kinds, present in (
            (("KUBE-SVC-", "service-"), bool(r.cluster)),
            (("KUBE-SVL-", "local-"), bool(r.local)),
            (("KUBE-EXT-", "external-"), r.uses_external_chain),
        ):
            ipt[kinds[0]] += present
            nft[kinds[1]] += present
        # Source ranges: iptables mode only with endpoints, nftables mode always (upstream's own).
        ipt["KUBE-FW-"] += r.uses_firewall
        nft["firewall-"] += r.fenced
        ipt["KUBE-SEP-"] += len(r.reachable)
        # nft keeps per-endpoint chains only where affinity needs them (layout s elsewhere).
        nft["endpoint-"] += len(r.reachable) if svc.affinity_timeout else 0
    return {"iptables": +ipt, "nft": +nft}


def expected_elements(state: ClusterState, family: IPFamily) -> Counter[str]:
    """Elements per nft map/set, by kube-proxy's nftables rules."""
    out: Counter[str] = Counter()
    for svc, eps in state.service_ports(family):
        r = categorize(svc, eps, state.node)
        external = len(svc.external_ips) + len(svc.load_balancer_ips)
        if r.internal_no_endpoints is None:
            out["service-ips"] += 1
        else:
            out["no-endpoint-services"] += 1
        if r.has_endpoints:
            out["service-ips"] += external
            out["service-nodeports"] += bool(svc.node_port)
        if r.external_no_endpoints is not None:
            out["no-endpoint-services"] += external  # one map for every address, as kube-proxy's
            out["no-endpoint-nodeports"] += bool(svc.node_port)
        if r.fenced:  # with or without endpoints, as kube-proxy's nftables mode
            out["firewall-ips"] += len(svc.load_balancer_ips)
        if svc.affinity_timeout:
            out["affinity-sets"] += len(r.reachable)
        else:
            # One slot per endpoint of each endpoint-selecting chain, in the shard maps.
            out["slots"] += len(r.cluster) + len(r.local)
    # This node's endpoints, affinity ports' too, as kube-proxy's nftables mode hairpins them.
    hairpin = {
        ep.ip
        for svc, eps in state.service_ports(family)
        for ep in categorize(svc, eps, state.node).reachable
        if state.node.name and ep.node_name == state.node.name
    }
    out["hairpin"] = len(hairpin)
    return out


def check_iptables(state: ClusterState, ns: str, flavour: Flavour) -> None:
    for family in IPFamily:
        runner = IptablesRunner(family, ns, flavour)
        runner.restore(iptables_backend.render(state, family).restore_text(with_jumps=True))
        inv = from_iptables_save(runner.save())
        want = expected_chains(state, family)["iptables"]
        got = Counter({k: v for k, v in inv.chain_kinds.items() if v})
        assert got == want, f"IPv{family.value} {flavour.value}: chains {dict(got)} != {dict(want)}"
        # The fixed chains of both tables are there too.
        for chain in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                      "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL"):
            assert chain in inv.chain_names, chain


def check_nft(state: ClusterState, ns: str) -> None:
    session = NftSession(ns)
    for family in IPFamily:
        session.apply(nft_backend.render(state, family).script())
        fam = "ip" if family is IPFamily.V4 else "ip6"
        inv = from_nft_json(session.list_table(fam, "nfproxy") or {})
        want = expected_chains(state, family)["nft"]
        got = Counter({k: v for k, v in inv.chain_kinds.items() if v})
        assert got == want, f"IPv{family.value} nft: chains {dict(got)} != {dict(want)}"
        elements = expected_elements(state, family)
        for name in ("service-ips", "service-nodeports", "no-endpoint-services",
                     "no-endpoint-nodeports", "firewall-ips"):
            assert inv.elements.get(name, 0) == elements[name], (
                f"IPv{family.value} map {name}: {inv.elements.get(name, 0)} != {elements[name]}"
            )
        affinity_sets = sum(1 for n in inv.elements if n.startswith("affinity-"))
        assert affinity_sets == elements["affinity-sets"]
        slots = sum(v for n, v in inv.elements.items() if n.startswith("endpoints-"))
        assert slots == elements["slots"], f"IPv{family.value}: {slots} slots != {elements['slots']}"
        assert inv.elements.get("hairpin", 0) == elements["hairpin"]
        for base in ("nat-prerouting", "nat-output", "nat-postrouting", "filter-input",
                     "filter-forward", "filter-output", "services"):
            assert base in inv.chain_names, base


def example_state() -> ClusterState:
    result = manifests.load(EXAMPLES)
    assert result.errors == (), result.errors
    return result.state


@pytest.mark.parametrize("flavour", list(Flavour), ids=lambda f: f"iptables-{f.value}")
def test_examples_iptables(netns: str, flavour: Flavour) -> None:
    check_iptables(example_state(), netns, flavour)


def test_examples_nft(netns: str) -> None:
    check_nft(example_state(), netns)


@pytest.mark.parametrize("seed,services", [(1, 40), (2, 120), (3, 200)])
def test_random_cluster_iptables(netns: str, seed: int, services: int) -> None:
    state = random_cluster(random.Random(seed), services)
    for flavour in Flavour:
        check_iptables(state, netns, flavour)


@pytest.mark.parametrize("seed,services", [(1, 40), (2, 120), (3, 200)])
def test_random_cluster_nft(netns: str, seed: int, services: int) -> None:
    check_nft(random_cluster(random.Random(seed), services), netns)


def test_uniform_200_both_backends(netns: str) -> None:
    state = uniform_cluster(200, 10)
    check_nft(state, netns)
    check_iptables(state, netns, Flavour.LEGACY)


def test_reapplying_nft_is_idempotent(netns: str) -> None:
    """A full script applied over the rules it wrote leaves the same objects (no duplicates)."""
    state = random_cluster(random.Random(7), 60)
    session = NftSession(netns)
    script = nft_backend.render(state, IPFamily.V4).script()
    session.apply(script)
    first = from_nft_json(session.list_table("ip", "nfproxy") or {})
    session.apply(script)
    second = from_nft_json(session.list_table("ip", "nfproxy") or {})
    assert (first.chains, first.rules, first.elements) == (second.chains, second.rules, second.elements)
