"""The periodic check on real kernels, in throwaway namespaces (issue P.1).

The generation the check reads must stay put while nobody writes (reads included: `nft list`,
`iptables-save`) and move with any write by anyone else, or the periodic sync would either
rewrite an idle node or miss a repair. nft and iptables-nft read nf_tables' generation
(NFT_MSG_GETGEN); iptables-legacy each table's entry count and size (IPT_SO_GET_INFO).
"""

from __future__ import annotations

import pytest

from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import run
from nfproxy.testing import uniform_cluster
from tests.test_proxier import nft_snapshot

pytestmark = pytest.mark.kernel

KERNELS = [("nft", None), ("iptables", Flavour.LEGACY), ("iptables", Flavour.NFT)]
IDS = ["nft", "iptables-legacy", "iptables-nft"]


def snapshot(backend: str, flavour: Flavour | None, ns: str) -> object:
    if backend == "nft":
        return nft_snapshot(ns)
    saved = (IptablesRunner(f, ns, flavour).save(t) for f in IPFamily for t in ("filter", "nat"))
    return [[line for line in text.splitlines() if not line.startswith("#")] for text in saved]


def fresh(backend: str, flavour: Flavour | None, state: ClusterState) -> object:
    with netns_mod.throwaway("nfp-fresh") as ns:
        Proxier(backend, netns=ns, flavour=flavour).sync(state)
        return snapshot(backend, flavour, ns)


def read_everything(backend: str, flavour: Flavour | None, ns: str) -> None:
    """What `check`, `trace` and the metrics do between syncs: they must not look like writes."""
    if backend == "nft":
        NftSession(ns).list_table("ip", "nfproxy")
    else:
        snapshot(backend, flavour, ns)


def delete_externally(backend: str, flavour: Flavour | None, ns: str) -> None:
    """An admin flushes one service's chain by hand."""
    if backend == "nft":
        name = sorted(c for c in nft_snapshot(ns)["ip"]["chains"] if c.startswith("service-"))[0]  # type: ignore[index]
        run(["nft", "flush", "chain", "ip", "nfproxy", name], netns=ns)
        return
    runner = IptablesRunner(IPFamily.V4, ns, flavour)
    name = sorted(c for c in runner.chains("nat")["nat"] if c.startswith("KUBE-SVC-"))[0]
    run([runner.cmd, "-w", "5", "-t", "nat", "-F", name], netns=ns)


@pytest.mark.parametrize(("backend", "flavour"), KERNELS, ids=IDS)
def test_reads_leave_the_generation_and_a_write_by_hand_moves_it(
    netns: str, backend: str, flavour: Flavour | None
) -> None:
    proxier = Proxier(backend, netns=netns, flavour=flavour)
    proxier.sync(uniform_cluster(4, 2))
    kernel = proxier.kernels[IPFamily.V4]
    before = kernel.generation()
    read_everything(backend, flavour, netns)
    assert kernel.generation() == before
    delete_externally(backend, flavour, netns)
    assert kernel.generation() != before
    proxier.close()


@pytest.mark.parametrize(("backend", "flavour"), KERNELS, ids=IDS)
def test_the_periodic_sync_writes_nothing_until_someone_else_does_and_then_repairs(
    netns: str, backend: str, flavour: Flavour | None
) -> None:
    state = uniform_cluster(6, 3)
    with Proxier(backend, netns=netns, flavour=flavour) as proxier:
        assert proxier.sync(state).kind == "full"
        before = snapshot(backend, flavour, netns)
        for _ in range(2):
            idle = proxier.sync(state, check=True)
            assert (idle.kind, idle.operations) == ("noop", 0)
        delete_externally(backend, flavour, netns)
        assert snapshot(backend, flavour, netns) != before
        repair = proxier.sync(state, check=True)
        assert (repair.kind, repair.reason) == ("full", "rules changed outside nfproxy")
        assert snapshot(backend, flavour, netns) == fresh(backend, flavour, state)
        assert proxier.sync(state, check=True).kind == "noop"
