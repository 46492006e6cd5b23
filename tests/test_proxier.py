"""Sync tests: partial syncs write only what changed and end where a full sync would.

Each kernel test runs the proxier against a throwaway namespace and compares what the kernel
holds after a sequence of partial syncs with what a fresh namespace holds after one full apply
of the same state: the strongest statement a delta can satisfy.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.changes import diff
from nfproxy.kernel import netns
from nfproxy.kernel.iptables import IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.nft import NftKernel
from nfproxy.nftables import Rule, Transaction
from nfproxy.testing import random_cluster, uniform_cluster

pytestmark = pytest.mark.kernel


# --------------------------------------------------------------------------------------------
# What the kernel holds, in a form two namespaces can be compared by.


def nft_snapshot(ns: str) -> dict[str, object]:
    session = NftSession(ns)
    out: dict[str, object] = {}
    for fam, table in (("ip", "nfproxy"), ("ip6", "nfproxy"), ("ip", "nfproxy-off"), ("ip6", "nfproxy-off")):
        doc = session.list_table(fam, table)
        if doc is None:
            continue
        chains: dict[str, list[str]] = {}
        sets: dict[str, object] = {}
        # Lanes are the allocator's business and differ between a sequence of partial syncs
        # and one full sync: compare what a lane's ranges resolve to instead.
        slots: dict[str, list[tuple[int, int, object]]] = {}
        for obj in doc["nftables"]:
            body = obj.get("map")
            if body and body["name"].startswith(nft_backend.SHARD_PREFIX):
                # With per-element counters a key is {"elem": {"val": K, "counter": ...}}; a
                # range's value is {"range": [LOW, HIGH]}.
                spans = []
                for k, v in body.get("elem", []):
                    val = k["elem"]["val"] if isinstance(k, dict) and "elem" in k else k
                    low, high = val["range"] if isinstance(val, dict) else (val, val)
                    spans.append((low, high, v))
                slots[body["name"]] = spans
        for obj in doc["nftables"]:
            if "chain" in obj:
                chains.setdefault(obj["chain"]["name"], [])
            elif "rule" in obj:
                r = obj["rule"]
                chains.setdefault(r["chain"], []).append(json.dumps(resolve_slots(r["expr"], slots), sort_keys=True))
            elif "set" in obj or "map" in obj:
                body = obj.get("set") or obj.get("map")
                if body["name"].startswith(nft_backend.SHARD_PREFIX):
                    continue
                elems = body.get("elem", [])
                # Affinity sets fill up with traffic; only their declaration is compared.
                sets[body["name"]] = (
                    json.dumps(body.get("type")),
                    sorted(json.dumps(e, sort_keys=True) for e in elems)
                    if not body["name"].startswith("affinity-")
                    else [],
                )
        out[fam if table == "nfproxy" else f"{fam} {table}"] = {"chains": chains, "sets": sets}
    return out


def resolve_slots(expr: list, slots: dict[str, list[tuple[int, int, object]]]) -> list:
    out = []
    for stmt in expr:
        dnat = stmt.get("dnat") if isinstance(stmt, dict) else None
        m = dnat.get("addr", {}).get("map") if isinstance(dnat, dict) and isinstance(dnat.get("addr"), dict) else None
        if m and "numgen" in m.get("key", {}):
            ng = m["key"]["numgen"]
            first = ng.get("offset", 0) % (1 << 32)  # nft 1.0.6 prints an offset >= 2^31 negative
            last = first + ng["mod"] - 1
            targets = sorted(
                (json.dumps([high - low + 1, target], sort_keys=True)
                 for low, high, target in slots[m["data"].lstrip("@")] if first <= low and high <= last),
            )
            stmt = {"dnat": {"family": dnat.get("family"), "numgen-of": targets}}
        out.append(stmt)
    return out


def iptables_snapshot(ns: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for family in IPFamily:
        text = IptablesRunner(family, ns).save()
        table = ""
        chains: dict[str, list[str]] = {}
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                chains.setdefault(f"{table}/{line[1:].split(' ')[0]}", [])
            elif line.startswith("-A "):
                chain, rule = line[3:].split(" ", 1)
                chains.setdefault(f"{table}/{chain}", []).append(rule)
        out[str(family)] = chains
    return out


def fresh(backend: str, state: ClusterState) -> dict[str, object]:
    with netns.throwaway("nfp-fresh") as ns:
        Proxier(backend, netns=ns).sync(state)
        return nft_snapshot(ns) if backend == "nft" else iptables_snapshot(ns)


def snapshot(backend: str, ns: str) -> dict[str, object]:
    return nft_snapshot(ns) if backend == "nft" else iptables_snapshot(ns)


# --------------------------------------------------------------------------------------------
# Mutations of a state: each returns a new state differing in one service port.


def with_endpoints(state: ClusterState, key, eps) -> ClusterState:
    endpoints = dict(state.endpoints)
    if eps:
        endpoints[key] = sort_endpoints(eps)
    else:
        endpoints.pop(key, None)
    return dataclasses.replace(state, endpoints=endpoints)


def without_service(state: ClusterState, key) -> ClusterState:
    services = dict(state.services)
    del services[key]
    endpoints = dict(state.endpoints)
    endpoints.pop(key, None)
    return dataclasses.replace(state, services=services, endpoints=endpoints)


def with_service(state: ClusterState, other: ClusterState, key) -> ClusterState:
    services = dict(state.services)
    services[key] = other.services[key]
    endpoints = dict(state.endpoints)
    if key in other.endpoints:
        endpoints[key] = other.endpoints[key]
    return dataclasses.replace(state, services=services, endpoints=endpoints)


def mutate(rng: random.Random, state: ClusterState, pool: ClusterState) -> ClusterState:
    keys = sorted(state.services, key=str)
    key = rng.choice(keys)
    choice = rng.randrange(5)
    if choice == 0:
        return without_service(state, key)
    if choice == 1:
        new = [k for k in pool.services if k not in state.services]
        if new:
            return with_service(state, pool, rng.choice(sorted(new, key=str)))
    svc = state.services[key]
    eps = list(state.endpoints.get(key, ()))
    if choice == 2 and eps:
        eps.pop(rng.randrange(len(eps)))
        return with_endpoints(state, key, eps)
    if choice == 3:
        prefix = "10.250.0." if svc.family is IPFamily.V4 else "fd09::"
        eps.append(Endpoint(ip=f"{prefix}{rng.randrange(1, 250)}", port=9000, node_name="node-a"))
        return with_endpoints(state, key, list({e.address: e for e in eps}.values()))
    services = dict(state.services)
    services[key] = dataclasses.replace(svc, affinity_timeout=0 if svc.affinity_timeout else 30)
    return dataclasses.replace(state, services=services)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_no_change_sync_sends_nothing(backend: str) -> None:
    state = random_cluster(random.Random(1), 30)
    with netns.throwaway("nfp-sync") as ns:
        proxier = Proxier(backend, netns=ns)
        first = proxier.sync(state)
        assert first.kind == "full" and first.operations > 100
        before = snapshot(backend, ns)
        # The same object, then an equal state rebuilt from scratch (what a re-read gives).
        again = proxier.sync(state)
        rebuilt = random_cluster(random.Random(1), 30)
        assert rebuilt is not state and diff(state, rebuilt).empty
        third = proxier.sync(rebuilt)
        for result in (again, third):
            assert result.kind == "noop"
            assert result.operations == 0
        assert snapshot(backend, ns) == before


def test_nft_no_change_sends_zero_kernel_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at the kernel boundary, not from the proxier's own report."""
    state = uniform_cluster(50, 3)
    with netns.throwaway("nfp-sync") as ns:
        proxier = Proxier("nft", netns=ns)
        proxier.sync(state)
        proxier.sync(state)  # nothing stale is left over from a full sync on a fresh table
        sent: list[str] = []
        real = NftSession._cmd

        def counting(self: NftSession, text: str, **kw: bool) -> str:
            sent.append(text)
            return real(self, text, **kw)

        monkeypatch.setattr(NftSession, "_cmd", counting)
        for _ in range(5):
            assert proxier.sync(state).operations == 0
        assert sent == []


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_adding_and_removing_one_service_touches_only_it(backend: str) -> None:
    base = uniform_cluster(40, 3)
    extra = uniform_cluster(41, 3)
    key = next(k for k in extra.services if k not in base.services)
    grown = with_service(base, extra, key)
    with netns.throwaway("nfp-sync") as ns:
        proxier = Proxier(backend, netns=ns)
        proxier.sync(base)
        before = snapshot(backend, ns)
        added = proxier.sync(grown)
        assert added.kind == "partial" and added.services_changed == 1
        after = snapshot(backend, ns)
        assert after == fresh(backend, grown)
        if backend == "nft":
            # Only the new service's chains and its map element differ; nothing else moved.
            old_chains, new_chains = before["ip"]["chains"], after["ip"]["chains"]
            changed = {c for c in new_chains if new_chains[c] != old_chains.get(c)}
            assert changed and all("ns-40/svc-40/" in c for c in changed), changed
            assert set(old_chains) <= set(new_chains)
            old_sets, new_sets = before["ip"]["sets"], after["ip"]["sets"]
            grown_sets = {n for n in new_sets if new_sets[n] != old_sets.get(n)}
            # Its cluster IP too; not the hairpin set: its endpoints are on another node (kube-proxy's
            # nftables mode hairpins this node's endpoints only).
            assert grown_sets == {"service-ips", "cluster-ips"}
            assert len(new_sets["service-ips"][1]) == len(old_sets["service-ips"][1]) + 1
            assert added.operations <= 20, added
        else:
            # The top-level chains are rewritten (as kube-proxy does); of the per-service
            # chains only the new service's appear in the payload.
            assert added.operations < 200
        removed = proxier.sync(base)
        assert removed.kind == "partial" and removed.services_changed == 1
        if backend == "nft":
            # The chains are emptied now and deleted by the next sync.
            assert proxier.backend.pending()
            cleaned = proxier.sync(base)
            assert cleaned.kind == "partial" and cleaned.operations == 1  # its service chain
            assert not proxier.backend.pending()
        assert snapshot(backend, ns) == before


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_partial_syncs_converge_to_the_full_ruleset(backend: str) -> None:
    rng = random.Random(7)
    state = random_cluster(random.Random(3), 40)
    pool = random_cluster(random.Random(4), 60)
    with netns.throwaway("nfp-sync") as ns:
        proxier = Proxier(backend, netns=ns)
        proxier.sync(state)
        kinds = []
        for step in range(12):
            state = mutate(rng, state, pool)
            kinds.append(proxier.sync(state).kind)
            if step % 4 == 3:
                proxier.sync(state)  # lets stale nft chains go
                assert snapshot(backend, ns) == fresh(backend, state), f"step {step}"
        assert kinds.count("partial") >= 8, kinds


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_failed_apply_keeps_previous_rules_and_forces_full_sync(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = uniform_cluster(20, 3)
    grown = with_service(base, uniform_cluster(21, 3), next(k for k in uniform_cluster(21, 3).services if k not in base.services))
    with netns.throwaway("nfp-sync") as ns:
        proxier = Proxier(backend, netns=ns)
        proxier.sync(base)
        before = snapshot(backend, ns)
        # A real kernel refusal: the transaction gains one command the kernel rejects.
        if backend == "nft":
            real = NftKernel.apply

            def broken(self: NftKernel, tx: Transaction) -> None:
                tx.add(Rule("no-such-chain", "accept"))
                real(self, tx)

            monkeypatch.setattr(NftKernel, "apply", broken)
        else:
            real_restore = IptablesRunner.restore

            def broken_restore(self: IptablesRunner, payload, **kw: bool) -> None:  # noqa: ANN001
                text = payload if isinstance(payload, str) else "".join(payload())  # pieces, streamed
                real_restore(self, text.replace("COMMIT\n", "-A NO-SUCH-CHAIN -j ACCEPT\nCOMMIT\n", 1), **kw)

            monkeypatch.setattr(IptablesRunner, "restore", broken_restore)
        with pytest.raises(KernelError):
            proxier.sync(grown)
        assert snapshot(backend, ns) == before
        monkeypatch.undo()
        retried = proxier.sync(grown)
        assert retried.kind == "full"
        assert snapshot(backend, ns) == fresh(backend, grown)
        assert proxier.sync(grown).kind == "noop"


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_full_sync_removes_what_a_previous_run_left(backend: str) -> None:
    """A restart: the new process knows nothing about what the old one wrote."""
    big = uniform_cluster(30, 2)
    small = uniform_cluster(10, 2)
    with netns.throwaway("nfp-sync") as ns:
        Proxier(backend, netns=ns).sync(big)
        proxier = Proxier(backend, netns=ns)
        assert proxier.sync(small).kind == "full"
        proxier.sync(small)  # deletes what the full sync emptied
        assert snapshot(backend, ns) == fresh(backend, small)


def test_iptables_jumps_are_not_duplicated() -> None:
    state = uniform_cluster(5, 2)
    with netns.throwaway("nfp-sync") as ns:
        for _ in range(3):
            Proxier("iptables", netns=ns).sync(state)
        text = IptablesRunner(IPFamily.V4, ns).save("nat")
        assert len(re.findall(r"^-A PREROUTING .*KUBE-SERVICES", text, re.M)) == 1
        assert len(re.findall(r"^-A OUTPUT .*KUBE-SERVICES", text, re.M)) == 1
