"""The nfnetlink fast path: byte-compatible with libnftables, atomic, and honest about its limits.

The strongest check: the same partial-sync transactions (rendered by the nft backend at test
time, so whatever layout it has today) go through NetlinkNft into one namespace and through
libnftables into another, both starting from the same full sync; the kernel must then hold the
same table, as nft decodes it to JSON and as it prints the raw expressions (registers, lengths,
byte order) with --debug=netlink.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import random
import re
import subprocess
import socket
import sys
import threading

import pytest

from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.changes import diff
from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.nfnetlink.values import TYPE_INET_SERVICE, TYPE_INTEGER, TYPE_IPV4, Field, SetType, Unsupported
from nfproxy.kernel.nft_netlink import NetlinkNft
from nfproxy.kernel.process import KernelError, find_tool
from nfproxy.nftables import OFF_TABLE, Chain, Counter, Element, Map, Rule, Set, Table, Transaction
from nfproxy.nftables import text as nft_text
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.testing import random_cluster
from tests.nft_oracle import MAX_MESSAGES, compile_transaction, unencodable

TABLE = nft_backend.TABLE
FAMILIES = {IPFamily.V4: "ip", IPFamily.V6: "ip6"}
# Transactions that declare sets and maps are outside the vocabulary by design (rare: a new
# endpoint map every 16 lanes, affinity sets): the bulk compiler says them, declarations
# included; which ones they are is known from their objects (`unencodable`), before anything is
# compiled.


# --------------------------------------------------------------------------------------------
# What the kernel holds.


def _strip_handles(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _strip_handles(v) for k, v in obj.items() if k != "handle"}
    if isinstance(obj, list):
        return [_strip_handles(x) for x in obj]
    return obj


def _netlink_text(raw: str) -> list[tuple[str, list[str]]]:
    """`nft --debug=netlink list table` as blocks: rule headers lose their handle numbers, and
    set blocks their element order (a hash set lists in insertion-history order)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            blocks.append((re.sub(r"( \d+)+$", "", line), []))
        else:
            blocks[-1][1].append(line.strip())
    return [(head, sorted(body) if " @" in head else body) for head, body in blocks]


def kernel_view(ns: str) -> dict[str, object]:
    """Both families' tables (and off tables, when there are) as nft -j lists them, and the raw
    expressions of every rule."""
    session = NftSession(ns)
    out: dict[str, object] = {}
    for fam in FAMILIES.values():
        for table in (TABLE, OFF_TABLE):
            listed = session.list_table(fam, table)
            if listed is None and table == OFF_TABLE:
                continue
            doc = _strip_handles(listed)
            for obj in doc["nftables"]:  # type: ignore[index]
                for kind in ("set", "map"):
                    if kind in obj and "elem" in obj[kind]:
                        obj[kind]["elem"] = sorted(obj[kind]["elem"], key=repr)
            where = fam if table == TABLE else f"{fam} {table}"
            out[where] = doc
            raw = subprocess.run(
                [find_tool("ip"), "netns", "exec", ns, find_tool("nft"), "--debug=netlink", "list", "table", fam, table],
                capture_output=True, text=True, check=True,
            ).stdout
            out[f"{where}-netlink"] = _netlink_text(raw)
    return out


# --------------------------------------------------------------------------------------------
# One-service mutations of a cluster.


def _mutate(rng: random.Random, state: ClusterState, pool: ClusterState) -> ClusterState:
    key = rng.choice(sorted(state.services, key=str))
    svc = state.services[key]
    eps = list(state.endpoints.get(key, ()))
    services = dict(state.services)
    endpoints = dict(state.endpoints)
    choice = rng.randrange(6)
    if choice == 0:  # service removed
        del services[key]
        endpoints.pop(key, None)
    elif choice == 1:  # service added
        new = sorted((k for k in pool.services if k not in services), key=str)
        if new:
            k = rng.choice(new)
            services[k] = pool.services[k]
            if k in pool.endpoints:
                endpoints[k] = pool.endpoints[k]
    elif choice == 2 and eps:  # endpoint removed
        eps.pop(rng.randrange(len(eps)))
    elif choice in (2, 3):  # endpoints added
        prefix = "10.250.0." if svc.family is IPFamily.V4 else "fd09::"
        for _ in range(rng.randint(1, 20)):
            eps.append(Endpoint(ip=f"{prefix}{rng.randrange(1, 250)}", port=9000 + rng.randrange(3), node_name="node-a"))
    elif choice == 4 and eps:  # an endpoint turns unready / terminating
        i = rng.randrange(len(eps))
        eps[i] = dataclasses.replace(eps[i], ready=False, serving=rng.random() < 0.5, terminating=True)
    else:  # the service itself changes: its port
        services[key] = dataclasses.replace(svc, port=svc.port + 1000)
    if choice >= 2:
        unique = list({e.address: e for e in eps}.values())
        if unique:
            endpoints[key] = sort_endpoints(unique)
        else:
            endpoints.pop(key, None)
    return dataclasses.replace(state, services=services, endpoints=endpoints)


def _full(state: ClusterState, *namespaces: str) -> dict[IPFamily, nft_backend.NftRuleset]:
    applied = {}
    for family in FAMILIES:
        rs = nft_backend.render(state, family)
        for ns in namespaces:
            NftSession(ns).apply(rs.script())
        applied[family] = rs
    return applied


@pytest.mark.kernel
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_deltas_through_netlink_leave_the_kernel_as_libnftables_does(seed: int) -> None:
    rng = random.Random(seed)
    state = random_cluster(rng, 20)
    pool = random_cluster(random.Random(seed + 100), 40)
    sent = fell_back = 0
    with netns.throwaway("nfp-nl-a") as a, netns.throwaway("nfp-nl-b") as b:
        fast, slow_a, slow_b = NetlinkNft(a), NftSession(a), NftSession(b)
        applied = _full(state, a, b)
        stale: dict[IPFamily, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        try:
            for _step in range(10):
                new_state = _mutate(rng, state, pool)
                changes = diff(state, new_state)
                for family, fam in FAMILIES.items():
                    keys = changes.of(family)
                    chains, sets = stale.get(family, ((), ()))
                    if not keys and not chains and not sets:
                        continue
                    new = nft_backend.render_update(applied[family], new_state, keys)
                    if isinstance(new, nft_backend.Cannot):
                        applied[family] = nft_backend.render(new_state, family)
                        for session in (slow_a, slow_b):
                            session.apply(applied[family].script())
                        stale.pop(family, None)
                        fast.forget()
                        continue
                    d = nft_backend.delta(applied[family], new, keys, delete_chains=chains, delete_sets=sets)
                    if d.transaction:
                        why = unencodable(d.transaction)
                        if why is None:
                            fast.apply(d.transaction)  # Unsupported fails the test
                            sent += 1
                        else:
                            assert "declarations" in why, why
                            slow_a.apply(d.script())
                            fell_back += 1
                        slow_b.apply(d.script())
                    applied[family] = new
                    stale[family] = (d.stale_chains, d.stale_sets)
                state = new_state
                assert kernel_view(a) == kernel_view(b)
        finally:
            fast.close()
    assert sent >= 3, (sent, fell_back)


def _one_service_deltas(base: ClusterState, applied: nft_backend.NftRuleset, key) -> list[nft_backend.NftDelta]:
    """Three endpoints added, removed again, the service removed, added back: four deltas."""
    family = key[1]
    prefix = "10.251.0." if family is IPFamily.V4 else "fd0a::"
    more = sort_endpoints(
        [*base.endpoints.get(key, ()), *(Endpoint(ip=f"{prefix}{i}", port=80, node_name="node-b") for i in range(1, 4))]
    )
    grown = dataclasses.replace(base, endpoints={**base.endpoints, key: more})
    gone = dataclasses.replace(
        base,
        services={k: v for k, v in base.services.items() if k != key},
        endpoints={k: v for k, v in base.endpoints.items() if k != key},
    )
    out = []
    previous, current = applied, base
    stale: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    for target in (grown, base, gone, base):
        keys = diff(current, target).of(family)
        new = nft_backend.render_update(previous, target, keys)
        d = nft_backend.delta(previous, new, keys, delete_chains=stale[0], delete_sets=stale[1])
        out.append(d)
        previous, current, stale = new, target, (d.stale_chains, d.stale_sets)
    return out


@pytest.mark.kernel
def test_a_one_service_change_is_fully_covered() -> None:
    """Endpoints added and removed, a service removed and added, IPv4 and IPv6: no fallback.

    Only a change that needs a new set or map (a first service in a new shard, affinity sets)
    may fall back; the services picked here are those whose changes need none.
    """
    base = random_cluster(random.Random(7), 60)
    with netns.throwaway("nfp-nl-a") as a, netns.throwaway("nfp-nl-b") as b:
        fast = NetlinkNft(a)
        try:
            applied = _full(base, a, b)
            covered = {family: 0 for family in FAMILIES}
            for family, fam in FAMILIES.items():
                for key in sorted((k for k in base.services if k[1] is family), key=str):
                    deltas = _one_service_deltas(base, applied[family], key)
                    if any(unencodable(d.transaction) for d in deltas):
                        continue
                    for d in deltas:
                        fast.apply(d.transaction)  # Unsupported fails the test
                        NftSession(b).apply(d.script())
                    # The last delta restored `base`: the next service starts from `applied`.
                    assert kernel_view(a) == kernel_view(b)
                    covered[family] += 1
                    if covered[family] == 3:
                        break
            assert all(n >= 2 for n in covered.values()), covered
        finally:
            fast.close()


@pytest.mark.kernel
def test_a_refused_transaction_raises_and_changes_nothing() -> None:
    state = random_cluster(random.Random(4), 10)
    with netns.throwaway("nfp-nl") as ns:
        fast = NetlinkNft(ns)
        try:
            _full(state, ns)
            before = kernel_view(ns)
            bad = f"add rule ip {TABLE} services jump no-such-chain"
            objects = [
                Chain("fresh-chain"),
                Rule("fresh-chain", "ip saddr 10.9.9.9 drop"),
                Element("service-ips", "172.31.9.9 . tcp . 80", "goto fresh-chain"),
                Rule("services", "jump no-such-chain"),
                Rule("fresh-chain", "drop"),
            ]

            def transaction(objs: list) -> Transaction:  # noqa: ANN001
                tx = Transaction("ip", TABLE)
                for obj in objs:
                    tx.add(obj)
                return tx

            with pytest.raises(KernelError) as caught:
                fast.apply(transaction(objects))
            assert caught.value.errno == errno.ENOENT  # type: ignore[attr-defined]
            assert caught.value.command == bad  # type: ignore[attr-defined]
            assert "no-such-chain" in str(caught.value)
            assert kernel_view(ns) == before
            # The socket is still usable, and the same commands without the bad one go through.
            fast.apply(transaction([o for o in objects if o != Rule("services", "jump no-such-chain")]))
            assert "fresh-chain" in str(NftSession(ns).list_table("ip", TABLE))
        finally:
            fast.close()


@pytest.mark.parametrize(
    ("family", "verb", "obj"),
    [
        ("ip", "add", Map("endpoints-9", typeof="numgen random mod 1 : meta l4proto")),
        ("ip", "add", Set("affinity-x", "ether_addr")),
        ("ip", "add", Rule("services", "ct state != new jump services")),
        ("ip", "add", Rule("services", "masquerade")),
        ("ip", "add", Rule("services", "reject with tcp reset")),
        ("ip", "add", Rule("services", "tcp dport 80 drop")),
        ("ip", "add", Rule("services", "ip saddr != { 10.0.0.1, 10.0.0.2 } drop")),
        ("ip", "add", Chain("x", "nat", "output", "dstnat")),
        ("ip", "create", Chain("x")),
        ("ip6", "add", Rule("services", "ip saddr 10.0.0.1 drop")),
    ],
)
def test_unsupported_transactions_raise_before_anything_is_sent(family: str, verb: str, obj: object) -> None:
    """A NetlinkNft bound to a namespace that does not exist: any socket would fail loudly.
    (Commands on another table or with handles cannot be said as objects at all any more.)"""
    fast = NetlinkNft("nfp-nl-never-created")
    tx = Transaction(family, TABLE)
    tx.add(Chain("fine"))
    getattr(tx, verb)(obj)
    with pytest.raises(Unsupported):
        fast.apply(tx)
    assert fast.messages_sent == 0
    assert not netns.exists("nfp-nl-never-created")


def test_what_netlink_cannot_say_is_known_from_the_objects() -> None:
    """Declarations and base chains are refused by kind, without compiling or reading a set."""
    tx = Transaction("ip", TABLE)
    tx.add(Chain("a"))
    tx.add(Rule("a", "drop"))
    tx.add(Element("service-ips", "10.0.0.1 . tcp . 80", "goto a"))
    assert unencodable(tx) is None
    tx.add(Set("affinity-a", "ipv4_addr", flags=("dynamic", "timeout"), timeout=10))
    assert "declarations" in (unencodable(tx) or "")


def test_only_deletions_of_sets_and_tables_are_in_the_vocabulary() -> None:
    """A set, map, counter or table declared, a base chain, too many operations (a full sync):
    each turned away by kind, before anything is compiled; a set deleted, or the transaction's
    own table, is said."""
    def partial() -> Transaction:
        tx = Transaction("ip", TABLE)
        tx.add(Chain("a"))
        tx.add(Rule("a", "drop"))
        return tx

    for extra in (Set("affinity-a", "ipv4_addr", flags=("dynamic", "timeout"), timeout=10), Map("m", "ipv4_addr : verdict"),
                  Table("ip", TABLE), Counter("c"), Chain("filter-input", type="filter", hook="input", priority=-110)):
        tx = partial()
        tx.add(extra)
        assert unencodable(tx) is not None, extra
    gone = partial()
    gone.delete(Set("affinity-a", "ipv4_addr"))
    gone.delete(Table("ip", TABLE))
    assert unencodable(gone) is None
    big = partial()
    big.add_elements(Element("service-ips", f"10.0.{i // 256}.{i % 256} . tcp . 80", "goto a") for i in range(MAX_MESSAGES))
    assert "large" in (unencodable(big) or "")


def test_element_keys_are_typed_by_the_set_declaration() -> None:
    """The same text `16` is a host-order slot in a shard map and a big-endian port elsewhere."""
    types = {
        "slots": SetType("slots", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV4, 4), Field(TYPE_INET_SERVICE, 2))),
        "ports": SetType("ports", (Field(TYPE_INET_SERVICE, 2),), None),
    }
    tx = Transaction("ip", TABLE)
    tx.add(Element("slots", "16", "10.1.0.1 . 8080"))
    tx.add(Element("ports", "16"))
    msgs = compile_transaction(tx, types.__getitem__)
    def attr(attrs: object, name: str) -> object:
        return next(a[1] for a in attrs if a[0] == name)  # type: ignore[union-attr]

    slot_elem = attr(msgs[0].attrs, "NFTA_SET_ELEM_LIST_ELEMENTS")[0]["attrs"]  # type: ignore[index]
    port_elem = attr(msgs[1].attrs, "NFTA_SET_ELEM_LIST_ELEMENTS")[0]["attrs"]  # type: ignore[index]
    key = attr(attr(slot_elem, "NFTA_SET_ELEM_KEY")["attrs"], "NFTA_DATA_VALUE")  # type: ignore[index]
    assert key == (16).to_bytes(4, sys.byteorder)
    data = attr(attr(slot_elem, "NFTA_SET_ELEM_DATA")["attrs"], "NFTA_DATA_VALUE")  # type: ignore[index]
    assert data == bytes([10, 1, 0, 1, 0x1F, 0x90, 0, 0])  # the port padded to 4 bytes
    port = attr(attr(port_elem, "NFTA_SET_ELEM_KEY")["attrs"], "NFTA_DATA_VALUE")  # type: ignore[index]
    assert port == b"\x00\x10"


@pytest.mark.kernel
def test_the_proxier_sends_partial_syncs_through_netlink() -> None:
    from nfproxy.daemon.proxier import Proxier

    base = random_cluster(random.Random(11), 40)
    key = sorted((k for k in base.services if not base.services[k].affinity_timeout), key=str)[0]
    eps = [*base.endpoints.get(key, ()), Endpoint(ip="10.252.0.1" if key[1] is IPFamily.V4 else "fd0b::1", port=80)]
    grown = dataclasses.replace(base, endpoints={**base.endpoints, key: sort_endpoints(eps)})
    with netns.throwaway("nfp-nl-a") as a, netns.throwaway("nfp-nl-b") as b:
        proxier = Proxier("nft", netns=a)
        proxier.sync(base)
        fast = proxier.kernels[key[1]].fast  # type: ignore[attr-defined]
        assert fast is not None and fast.messages_sent > 0  # the full sync's batch
        sent = fast.messages_sent
        assert proxier.sync(grown).kind == "partial"
        assert fast.messages_sent > sent
        Proxier("nft", netns=b).sync(grown)
        assert kernel_view(a) == kernel_view(b)
        fast.close()


@pytest.mark.kernel
def test_named_counters_over_netlink_are_what_nft_lists() -> None:
    """Names and packets of one table's counters only: not another table's, not other objects."""
    with netns.throwaway("nfp-nl") as ns:
        session = NftSession(ns)
        session.apply(
            "add table ip nfp-a\nadd counter ip nfp-a one\nadd counter ip nfp-a two\n"
            "add quota ip nfp-a q { over 10 mbytes }\n"
            "add chain ip nfp-a out { type filter hook output priority 0 ; }\n"
            'add rule ip nfp-a out ip daddr 127.0.0.1 counter name "two"\n'
            "add table ip nfp-b\nadd counter ip nfp-b three\n"
        )
        send = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n" \
               "for _ in range(3): s.sendto(b'x', ('127.0.0.1', 9))"
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", send], check=True, capture_output=True)
        fast = NetlinkNft(ns)
        try:
            doc = session.list_table("ip", "nfp-a") or {}
            nft_says = {o["counter"]["name"]: o["counter"]["packets"] for o in doc["nftables"] if "counter" in o}
            # Three datagrams out, and the port-unreachable errors coming back over lo.
            assert fast.counters("ip", "nfp-a") == nft_says and nft_says["one"] == 0 and nft_says["two"] >= 3
            assert fast.counters("ip", "nfp-b") == {"three": 0}
            assert fast.counters("ip", "nfp-none") == {} and fast.counters("ip6", "nfp-a") == {}
            listed = session.object_names("ip", "nfp-a")
            assert listed is not None and listed[2] == {"one", "two"}
        finally:
            fast.close()


def _sockets(fast: NetlinkNft) -> list[socket.socket]:
    """The sockets a NetlinkNft holds open now: its reader's and its batch socket."""
    return [r._sock for r in fast._reader if r._sock is not None] + list(fast._raw)


@pytest.mark.kernel
def test_close_closes_the_sockets_every_thread_used() -> None:
    """The daemon syncs in one thread, reads counters in another and shuts down from a third:
    one close closes every socket, and a later use opens anew."""
    with netns.throwaway("nfp-nl") as ns:
        NftSession(ns).apply("add table ip nfp-a\nadd counter ip nfp-a one\n")
        fast = NetlinkNft(ns)
        assert fast.counters("ip", "nfp-a") == {"one": 0}
        seen: list[dict[str, int]] = []
        worker = threading.Thread(target=lambda: seen.append(fast.counters("ip", "nfp-a")))
        worker.start()
        worker.join()
        assert seen == [{"one": 0}]
        held = _sockets(fast)
        assert len(held) == 1 and held[0].fileno() >= 0
        fast.close()
        assert all(sock.fileno() == -1 for sock in held) and _sockets(fast) == []
        assert fast.counters("ip", "nfp-a") == {"one": 0} and len(_sockets(fast)) == 1
        assert fast.counters("ip", "nfp-none") == {}  # no such table
        fast.close()


@pytest.mark.kernel
def test_bulk_batches_go_on_one_raw_socket_kept_until_close() -> None:
    """Full syncs (and the off table's creation) are sent by nft_bulk on one raw socket, kept:
    closing a netlink socket right after a commit waits out the kernel's freeing of what the
    commit deleted."""
    from nfproxy.daemon.proxier import Proxier

    state = random_cluster(random.Random(6), 12)
    with netns.throwaway("nfp-nl") as ns:
        proxier = Proxier("nft", netns=ns)
        fast = proxier.kernels[IPFamily.V4].fast  # type: ignore[attr-defined]
        assert proxier.sync(state).kind == "full"
        (first,) = fast._raw
        assert proxier.sync(state, full=True).kind == "full"
        assert fast._raw == [first]
        proxier.close()
        assert fast._raw == [] and first.fileno() == -1


@pytest.mark.kernel
def test_a_netlink_object_dropped_unclosed_closes_its_sockets() -> None:
    """Dropped without close (a proxier a command or a test lets go of), its sockets are closed
    when it is collected, with nothing left to the collector to complain about."""
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with netns.throwaway("nfp-nl") as ns:
            NftSession(ns).apply("add table ip nfp-a\n")
            fast = NetlinkNft(ns)
            fast.counters("ip", "nfp-a")
            tx = Transaction("ip", "nfp-a")
            tx.add(Chain("c"))
            fast.apply(tx)
            held = _sockets(fast)
            del fast, tx
            gc.collect()
            assert len(held) == 2 and all(sock.fileno() == -1 for sock in held)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []


@pytest.mark.kernel
def test_a_closed_proxier_syncs_again() -> None:
    """Proxier.close lets go of the sockets, not of what it knows: the next sync is partial."""
    from nfproxy.daemon.proxier import Proxier

    base = random_cluster(random.Random(5), 10)
    with netns.throwaway("nfp-nl") as ns, Proxier("nft", netns=ns) as proxier:
        assert proxier.sync(base).kind == "full"
        fast = proxier.kernels[IPFamily.V4].fast  # type: ignore[attr-defined]
        held = _sockets(fast)
        proxier.close()
        assert held and all(sock.fileno() == -1 for sock in held)
        key = sorted(k for k in base.services if k[1] is IPFamily.V4 and not base.services[k].affinity_timeout)[0]
        eps = [*base.endpoints.get(key, ()), Endpoint(ip="10.252.0.9", port=80)]
        grown = dataclasses.replace(base, endpoints={**base.endpoints, key: sort_endpoints(eps)})
        assert proxier.sync(grown).kind == "partial"
        assert fast.messages_sent > 0


def _grown_affinity(base: ClusterState) -> tuple[ClusterState, str]:
    """`base` with two endpoints more on an affinity port (one set each), and their prefix."""
    key = sorted((k for k in base.services if base.services[k].affinity_timeout), key=str)[0]
    prefix = "10.253.0." if key[1] is IPFamily.V4 else "fd0c::"
    eps = [*base.endpoints.get(key, ()), *(Endpoint(ip=f"{prefix}{i}", port=80) for i in (1, 2))]
    return dataclasses.replace(base, endpoints={**base.endpoints, key: sort_endpoints(eps)}), prefix


def _one_more_service(full: ClusterState) -> ClusterState:
    """`full`'s services but its last (in lane order, name order here): the last one then opens
    a new endpoint map when it is added."""
    keys = sorted(full.services, key=lambda k: int(k[0].name.split("-")[1]))[:-1]
    return dataclasses.replace(full, services={k: full.services[k] for k in keys}, endpoints={k: full.endpoints[k] for k in keys})


@pytest.mark.kernel
@pytest.mark.parametrize("case", ["affinity sets", "an endpoint map"])
def test_a_partial_sync_that_declares_sets_is_one_bulk_batch(case: str) -> None:
    """A partial sync that declares sets (two endpoints of an affinity port: a set each) or a
    map (the service that fills the lanes of the last endpoint map opens the next) goes as one
    batch from the bulk compiler, its declarations written from the objects: no libnftables call,
    whose cache dump would list every element of every interval map first, and one commit. The table ends as the same partial sync through
    libnftables alone leaves it, and the other sets' element types stay known (no round trip to
    ask the kernel again)."""
    from nfproxy.backends.nft.render import LANES_PER_MAP
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.testing import uniform_cluster

    if case == "affinity sets":
        base = random_cluster(random.Random(12), 40)
        grown, prefix = _grown_affinity(base)
        family, new_sets = IPFamily.V4 if prefix[0] == "1" else IPFamily.V6, 2
    else:
        grown = uniform_cluster(LANES_PER_MAP + 1, 3)
        base, family, new_sets = _one_more_service(grown), IPFamily.V4, 1
    with netns.throwaway("nfp-nl-a") as a, netns.throwaway("nfp-nl-b") as b:
        proxier = Proxier("nft", netns=a)
        proxier.sync(base)
        kernel = proxier.kernels[family]
        fast = kernel.fast  # type: ignore[attr-defined]
        scripts: list[str] = []
        real_apply = kernel.session.apply  # type: ignore[attr-defined]
        kernel.session.apply = lambda script: (scripts.append(script), real_apply(script))  # type: ignore[attr-defined]
        bulk: list[Transaction] = []
        real_bulk = fast.apply
        fast.apply = lambda *txs: (bulk.extend(txs), real_bulk(*txs))[1]
        known = set(fast._set_types)
        owned = set(kernel.owned().sets)  # type: ignore[attr-defined]
        assert proxier.sync(grown).kind == "partial"
        assert scripts == [], scripts
        (tx,) = bulk
        added = {o.name for verb, o in tx.ops if type(o) in (Set, Map) and verb.value == "add"}
        assert len(added - owned) == new_sets, (added, owned)
        assert known <= set(fast._set_types) and {k[2] for k in fast._set_types} >= added
        slow = Proxier("nft", netns=b)
        for k in slow.kernels.values():
            k.fast = None  # type: ignore[attr-defined]
        slow.sync(base)
        assert slow.sync(grown).kind == "partial"
        assert kernel_view(a) == kernel_view(b)
        # Back to base: what the partial sync declared goes stale and the next syncs delete
        # it, over netlink, each a batch of its own (deleting a set needs no declaration).
        for state in (base, base):
            assert proxier.sync(state).kind in ("partial", "noop")
            assert slow.sync(state).kind in ("partial", "noop")
        assert scripts == [] and len(bulk) > 1 and kernel_view(a) == kernel_view(b)
        assert not (added - owned) & set(kernel.owned().sets)  # type: ignore[attr-defined]
        fast.close()


@pytest.mark.kernel
def test_a_weighted_affinity_choice_is_an_interval_vmap_through_netlink(caplog: pytest.LogCaptureFixture) -> None:
    """A ClientIP-affinity port with weights picks through an anonymous vmap of one range per
    endpoint (`numgen random mod 99950 vmap { 0-998 : goto …, 999-1998 : goto … }`), not one
    element per unit of weight (99 950 of them, which no analysis could walk). Its weight
    changes rewrite that rule: through netlink the kernel must hold what libnftables makes of it,
    ranges, end markers and byte order included."""
    from nfproxy.core.model import NodeConfig, Protocol, ServicePort, ServicePortName, ServiceType

    spn = ServicePortName("demo", "sticky", "http", Protocol.TCP)
    svc = ServicePort(spn, IPFamily.V4, ServiceType.CLUSTER_IP, "10.96.0.30", 80, affinity_timeout=10800)
    eps = sort_endpoints([Endpoint(f"10.244.0.{i + 1}", 8080, weight=999 + i % 2) for i in range(100)])
    base = ClusterState(NodeConfig(name="node-a"), {svc.key: svc}, {svc.key: eps})
    # Weighted affinity draws a modulus of its own: the port lives in the off table.
    rule = next(str(r) for rules in nft_backend.render(base, IPFamily.V4).off.services[svc.key].chains.values()  # type: ignore[union-attr]
                for r in rules if "numgen" in str(r))
    assert rule.startswith("numgen random mod 99950 vmap { 0-999 : goto ") and rule.count(" : goto ") == 100
    from nfproxy.kernel.nft import NftKernel

    with netns.throwaway("nfp-nl-a") as a, netns.throwaway("nfp-nl-b") as b:
        fast = NetlinkNft(a)
        kernel = NftKernel(IPFamily.V4, netns=a)
        try:
            # The full sync as the daemon sends it (one batch built from the objects, the rule
            # compiled as above) against libnftables reading the script.
            rendered = nft_backend.render(base, IPFamily.V4)
            with caplog.at_level("DEBUG", logger="nfproxy.kernel.nft"):
                kernel.apply(rendered.transactions())
            assert "through libnftables" not in caplog.text
            NftSession(b).apply(rendered.script())
            applied = rendered.off
            assert applied is not None
            for ns in (a, b):
                NftSession(ns).apply(nft_backend.render(base, IPFamily.V6).script())
            assert kernel_view(a) == kernel_view(b)
            state = base
            for weights in ((1000, 1), (0, 7), (3, 3)):  # a heavy first endpoint, a drained one, equal again
                changed = (dataclasses.replace(eps[0], weight=weights[0]), dataclasses.replace(eps[1], weight=weights[1]))
                new_state = dataclasses.replace(state, endpoints={svc.key: changed + eps[2:]})
                keys = diff(state, new_state).of(IPFamily.V4)
                new = nft_backend.update_table(applied, new_state, nft_backend.route(new_state, IPFamily.V4, keys))
                d = nft_backend.delta(applied, new, keys)
                # The affinity sets are declared again (`add set` is idempotent): through the
                # bulk compiler then, the rewritten rule among the rest; else through netlink.
                rest = d.transaction
                assert any(type(o) is Rule and "numgen" in str(o.body) for _, o in rest.operations())
                kernel.fast.apply(rest)  # type: ignore[union-attr]  # Unsupported fails the test
                NftSession(b).apply(d.script())
                assert kernel_view(a) == kernel_view(b)
                applied, state = new, new_state
        finally:
            fast.close()
            kernel.close()


def test_forgetting_one_tables_set_types_keeps_the_others() -> None:
    """A transaction through another path (libnftables, the bulk sender) may redeclare its own
    table's sets, nobody else's: the endpoint maps of nfproxy stay known when the off table is
    created; a refusal forgets everything."""
    fast = NetlinkNft()  # no socket until one is needed
    st = SetType("m", (Field(TYPE_IPV4, 4),), None)
    fast.know("ip", "nfproxy", {"a": st, "b": st})
    fast.know("ip", "nfproxy-off", {"a": st})
    fast.know("ip6", "nfproxy", {"a": st})
    fast.forget("ip", "nfproxy-off")
    assert set(fast._set_types) == {("ip", "nfproxy", "a"), ("ip", "nfproxy", "b"), ("ip6", "nfproxy", "a")}
    fast.forget()
    assert fast._set_types == {}
    fast.close()
