"""Full syncs as one nfnetlink batch (kernel/nft_bulk.py): the kernel must end up holding what
libnftables leaves for the same transaction, all of it or none of it."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from collections.abc import Callable
from typing import TypeVar

import pytest

from nfproxy.core.model import IPFamily
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns, nft_bulk
from nfproxy.kernel.nfnetlink import framing
from nfproxy.kernel.nft import NftKernel
from nfproxy.kernel import nft_wire
from nfproxy.kernel.nfnetlink.messages import _ElemListMsg
from nfproxy.kernel.nfnetlink.sender import NetlinkKernelError
from nfproxy.kernel.nfnetlink.values import (
    TYPE_INET_PROTO,
    TYPE_INET_SERVICE,
    TYPE_INTEGER,
    TYPE_IPV4,
    TYPE_IPV6,
    Field,
    Message,
    SetType,
    Unsupported,
)
from nfproxy.kernel.process import find_tool
from nfproxy.nftables import Chain, Element, Rule, Transaction, Verb
from nfproxy.testing import random_cluster

from tests.nft_oracle import _element
from tests.test_nft_netlink import kernel_view

T = TypeVar("T")

def _proxier(ns: str, *, bulk: bool) -> Proxier:
    return Proxier("nft", netns=ns, kernels=lambda f: NftKernel(f, netns=ns, netlink=bulk))


def _view(ns: str) -> dict[str, object]:
    """`kernel_view`, less what a table's history decides and its contents do not: the order
    nft lists objects in (creation order) and the numbers the kernel gives anonymous maps."""
    out: dict[str, object] = {}
    for key, value in kernel_view(ns).items():
        if isinstance(value, dict):
            out[key] = sorted(json.dumps(o, sort_keys=True) for o in value["nftables"])
        else:
            anonymous = re.compile(r"__(map|set)\d+")
            out[key] = sorted(
                (anonymous.sub(r"__\1", head), [anonymous.sub(r"__\1", line) for line in body])
                for head, body in value  # type: ignore[attr-defined]
                if not head.startswith("table ")  # the listing again, elements in hash order: the JSON has it
            )
    return out


def _tables(ns: str) -> str:
    return subprocess.run([find_tool("ip"), "netns", "exec", ns, find_tool("nft"), "list", "tables"],
                          capture_output=True, text=True, check=True).stdout


def capture_sends(monkeypatch: pytest.MonkeyPatch, keep: Callable[[nft_bulk.Batch], T]) -> list[T]:
    """keep(batch) of every transaction's batch that goes through nft_bulk.send_joined (every
    batch nfproxy sends), which still sends them."""
    seen: list[T] = []
    real = nft_bulk.send_joined

    def counted(batches: list[tuple[nft_bulk.Batch, Transaction]], ns: str | None, sock: object = None) -> None:
        seen.extend(keep(batch) for batch, _ in batches if batch.origins)
        real(batches, ns, sock)  # type: ignore[arg-type]

    monkeypatch.setattr(nft_bulk, "send_joined", counted)
    return seen


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many batches went through nft_bulk.send, and their sizes in messages."""
    return capture_sends(monkeypatch, lambda batch: len(batch.origins))


@pytest.mark.kernel
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_full_sync_in_one_batch_leaves_what_libnftables_leaves(seed: int, sends: list[int]) -> None:
    """A cold start, then a restart onto another cluster (the table exists; whatever the new
    state does not render is removed) through one batch each, against libnftables applying
    each state in a namespace of its own: the kernel must equal a fresh apply of the state.

    (Not against libnftables restarting onto the second state: its cache of the old interval
    set makes it leave an extra end element at 0.0.0.0 in `nodeport-ips`, which lists the
    same and which a fresh apply does not have.) Stale objects of the first state are emptied
    by the full sync and deleted by the cleanup sync after it, as the daemon runs them."""
    first = random_cluster(random.Random(seed), 40)
    second = random_cluster(random.Random(seed + 50), 30)
    full_syncs: list[int] = []
    with netns.throwaway("nfp-bulk") as ns:
        for state in (first, second):
            proxier = _proxier(ns, bulk=True)
            before = len(sends)
            assert proxier.sync(state).kind == "full"
            full_syncs += sends[before:]
            if proxier.backend.pending():  # what the full sync emptied goes in a sync of its own
                proxier.sync(state)
            with netns.throwaway("nfp-bulk-fresh") as fresh:
                assert _proxier(fresh, bulk=False).sync(state).kind == "full"
                assert _view(ns) == _view(fresh)
    assert len(full_syncs) == 4 and min(full_syncs) > 10, full_syncs  # both families, both syncs, one batch each


@pytest.mark.kernel
def test_full_syncs_never_call_libnftables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not even the first: every declaration and every fixed rule of the base chains is written
    from the objects (no scratch table, no other table of ours left in the namespace)."""
    state = random_cluster(random.Random(7), 20)
    with netns.throwaway("nfp-bulk-once") as ns:
        kernel = NftKernel(IPFamily.V4, netns=ns)
        scripts: list[str] = []
        real = kernel.session.apply
        monkeypatch.setattr(kernel.session, "apply", lambda text: (scripts.append(text), real(text))[1])
        for _ in range(2):
            assert Proxier("nft", netns=ns, families=(IPFamily.V4,), kernels=lambda f: kernel).sync(state).kind == "full"
        assert scripts == []
        assert _tables(ns).split() == ["table", "ip", "nfproxy"]


@pytest.mark.kernel
def test_partial_syncs_know_the_sets_a_full_sync_declared_as_the_kernel_has_them() -> None:
    """After a full sync no endpoint map costs partial syncs a round trip for its type, and
    what they were told is what the kernel answers."""
    state = random_cluster(random.Random(11), 30)
    with netns.throwaway("nfp-bulk-known") as ns:
        kernel = NftKernel(IPFamily.V4, netns=ns)
        proxier = Proxier("nft", netns=ns, families=(IPFamily.V4,), kernels=lambda f: kernel)
        proxier.sync(state)
        fast = kernel.fast
        assert fast is not None
        known = dict(fast._set_types)
        ruleset = proxier.backend.believed(IPFamily.V4)
        assert ruleset is not None
        declared = {*ruleset.sets, *ruleset.shard_users}  # the endpoint maps among them
        assert any(name.startswith("endpoints-") for name in ruleset.shard_users)
        assert {("ip", ruleset.table, name) for name in declared} <= set(known)
        fast.forget()
        for (family, table, name), st in known.items():
            assert fast.set_type(family, table, name) == st, name


@pytest.mark.kernel
def test_a_refused_batch_changes_nothing_and_names_the_command() -> None:
    state = random_cluster(random.Random(3), 20)
    with netns.throwaway("nfp-bulk-refused") as ns:
        _proxier(ns, bulk=True).sync(state)
        before = kernel_view(ns)
        kernel = NftKernel(IPFamily.V4, netns=ns)
        tx = Transaction("ip", "nfproxy")
        for i in range(5000):  # large: past the partial-sync encoder, into the bulk path
            tx.add(Chain(f"bulk-{i}"))
        tx.add(Rule("bulk-4999", "jump no-such-chain"))
        with pytest.raises(NetlinkKernelError) as caught:
            kernel.apply(tx)
        assert "add rule ip nfproxy bulk-4999 jump no-such-chain" in str(caught.value)
        assert kernel_view(ns) == before


# --------------------------------------------------------------------------------------------
# Elements are written straight to bytes; they must be the bytes the partial-sync path makes.


_V4, _V6 = Field(TYPE_IPV4, 4), Field(TYPE_IPV6, 16)
_PROTO, _PORT = Field(TYPE_INET_PROTO, 1), Field(TYPE_INET_SERVICE, 2)
_SETS = [
    (SetType("hairpin", (_V4, _V4), None), ["10.0.0.1 . 10.0.0.1", "10.9.8.7 . 10.9.8.7"]),
    (SetType("cluster-ips", (_V6,), None), ["fd00::1", "2001:db8::ff"]),
    (SetType("service-ips", (_V4, _PROTO, _PORT), (), verdict=True),
     ["172.30.0.1 . tcp . 80 : goto service-X-ns/a/tcp/http", "172.30.0.2 . udp . 53 : drop",
      "172.30.0.3 . sctp . 9 : jump reject-chain"]),
    (SetType("endpoints", (Field(TYPE_INTEGER, 4, True),), (_V4, _PORT), interval=True),
     ["0-99 : 10.1.2.3 . 8080", "100-4294967295 : 10.1.2.4 . 8080", "7 : 10.1.2.5 . 80"]),
    (SetType("nodeport-ips", (_V4,), None, interval=True),
     ["192.168.0.2/32", "0.0.0.0/0", "10.0.0.0/8", "10.1.0.1-10.1.0.9"]),
    (SetType("nodeport-ips6", (_V6,), None, interval=True), ["fd00::/64", "::/0"]),
]


def _element_of(name: str, text: str, comment: str) -> Element:
    key, _, value = text.partition(" : ")
    return Element(name, key, value, comment)


@pytest.mark.parametrize("st, texts", _SETS, ids=[st.name for st, _ in _SETS])
@pytest.mark.parametrize("adding", [True, False], ids=["add", "delete"])
@pytest.mark.parametrize("comment", ["", "ns-1/svc-2:http", 'a "quoted" one'])
def test_elements_are_the_bytes_the_partial_sync_path_sends(st: SetType, texts: list[str], adding: bool, comment: str) -> None:
    """Every element of a set in one message each way: the list entries numbered alike too."""
    els = [_element_of(st.name, text, comment) for text in texts]
    items = [item for el in els for item in _element(el, st, "", with_values=adding)]
    message = Message(_ElemListMsg, 12 if adding else 14, 0x400 if adding else 0, (
        ("NFTA_SET_ELEM_LIST_TABLE", "nfproxy"), ("NFTA_SET_ELEM_LIST_SET", st.name),
        ("NFTA_SET_ELEM_LIST_ELEMENTS", items, 0x8000)), "")
    reference = nft_wire.encode_message(message, 2, 1, ack=False)
    tx = Transaction("ip", "nfproxy")
    compiler = nft_bulk._Compiler(tx, lambda name: st)
    for i, el in enumerate(els):
        compiler.elements(i, Verb.ADD if adding else Verb.DELETE, st.name, iter(((el.key, el.value, el.comment),)), 1, st)
    assert len(compiler.parts) == len(els)
    # One message per element here, one message for all in the reference: compare the lists.
    ours = b"".join(_entries(part) for part in compiler.parts)
    assert _renumbered(ours) == _renumbered(_entries(reference))


def _entries(message: bytes) -> bytes:
    """The element list's entries of one element message."""
    at = 20 + len(framing.strz(1, "nfproxy"))
    at += (int.from_bytes(message[at: at + 2], "little") + 3) & ~3  # the set's name
    return message[at + 4:]


def _renumbered(entries: bytes) -> bytes:
    out, at, n = bytearray(), 0, 0
    while at < len(entries):
        length = int.from_bytes(entries[at: at + 2], "little")
        n += 1
        out += entries[at: at + 2] + (n | 0x8000).to_bytes(2, "little") + entries[at + 4: at + ((length + 3) & ~3)]
        at += (length + 3) & ~3
    return bytes(out)


@pytest.mark.parametrize("st, text", [
    (_SETS[0][0], "10.0.0.1"),  # one field of two
    (_SETS[0][0], "10.0.0.01 . 10.0.0.1"),  # a leading zero: nft refuses it
    (_SETS[1][0], "fd00::1%eth0"),  # a scope
    (_SETS[3][0], "5-3 : 10.1.2.3 . 80"),  # a backwards range
    (_SETS[3][0], "0-4294967296 : 10.1.2.3 . 80"),  # past the key's width
    (_SETS[2][0], "172.30.0.1 . tcp . 80"),  # a map element without its value
])
def test_an_element_outside_the_vocabulary_is_refused_before_sending(st: SetType, text: str) -> None:
    with pytest.raises(Unsupported):
        el = _element_of(st.name, text, "")
        nft_bulk.element_writer(st, True)((el.key, el.value, el.comment))


@pytest.mark.kernel
def test_a_scratch_table_an_earlier_release_left_is_cleaned_up() -> None:
    from nfproxy.daemon.cleanup import cleanup_nft
    from nfproxy.kernel.nft import NftSession

    with netns.throwaway("nfp-bulk-left") as ns:
        NftSession(ns).apply("add table ip nfproxy-scratch\nadd chain ip nfproxy-scratch stale\n")
        NftSession(ns).apply("add table ip6 nfproxy-scratch { flags dormant ; }\n")  # dormant: deleted all the same
        _proxier(ns, bulk=True).sync(random_cluster(random.Random(5), 10))
        removed = [r.what for r in cleanup_nft(ns)]
        assert {"nft: table ip nfproxy-scratch", "nft: table ip6 nfproxy-scratch", "nft: table ip nfproxy"} <= set(removed)
        assert "nfproxy" not in _tables(ns)


# The fixed rules of the base chains, in every form a node's configuration gives them.
_FIXED_RULES = [
    "ct state new jump marked",
    "ct state established,related accept",
    "ct state invalid counter name invalid-drops drop",
    "ct status dnat {ip} saddr . {ip} daddr @pairs jump marked",
    'iifname "cni0" goto marked comment "short-circuit pod traffic"',
    '{ip} daddr {address} iifname != "veth*" jump marked',
    "{ip} daddr {loopback} meta l4proto udp th dport @ports counter name invalid-drops reject",
    "meta mark and 0x4000 == 0 return",
    "meta mark and 0x4000 != 0 return",
    "meta mark set meta mark or 0x4000",
    "meta mark set meta mark xor 0x4000",
    "masquerade fully-random",
    "reject",
    '{ip} daddr @addresses reject comment "Reject traffic to invalid ports of ClusterIPs"',
]


@pytest.mark.kernel
def test_the_fixed_rules_leave_what_libnftables_leaves() -> None:
    """The words the rule compiler has for the base chains' rules (connection tracking, marks,
    interface names, named counters, reject, masquerade) leave the rules `nft -f` leaves."""
    from nfproxy.kernel.nft import NftSession
    from nfproxy.kernel.nft_netlink import NetlinkNft
    from nfproxy.nftables import Counter, Set, Table
    from nfproxy.nftables import text as nft_text

    with netns.throwaway("nfp-bulk-fixed") as a, netns.throwaway("nfp-bulk-fixed") as b:
        fast = NetlinkNft(a)
        for family, address, loopback, addr in (("ip", "10.0.0.1", "127.0.0.0/8", "ipv4_addr"), ("ip6", "fd00::1", "::1", "ipv6_addr")):
            tx = Transaction(family, "nfproxy")
            tx.add(Table(family, "nfproxy"))
            tx.add(Counter("invalid-drops"))
            for obj in (Set("pairs", f"{addr} . {addr}"), Set("addresses", addr), Set("ports", "inet_service"), Chain("marked")):
                tx.add(obj)
            tx.add(Chain("fixed", "filter", "output", "0"))
            tx.add(Chain("fixed-nat", "nat", "postrouting", "100"))  # masquerade's hook
            for body in _FIXED_RULES:
                chain = "fixed-nat" if "masquerade" in body else "fixed"
                tx.add(Rule(chain, body.format(ip=family, address=address, loopback=loopback)))
            fast.apply(tx)  # Unsupported fails the test
            NftSession(b).apply(nft_text.script(tx))
        fast.close()
        assert kernel_view(a) == kernel_view(b)


@pytest.mark.kernel
def test_elements_encoded_by_a_forked_helper_are_the_same_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sync's elements encoded in a forked child while the rules are compiled here, and
    again with a child that fails (the parent encodes them itself): the batch is byte for byte
    the one encoded in the process, and the kernel takes it."""
    from nfproxy.core import forked
    from nfproxy.testing import uniform_cluster

    monkeypatch.setattr(forked, "cpus", lambda: 2)
    parent = os.getpid()
    real_encode = nft_bulk._Compiler.encode
    helpers: list[bool] = []
    real_beside = forked.beside

    def beside(fn):  # noqa: ANN001, ANN202
        child = real_beside(fn)
        helpers.append(child is not None)
        return child

    def failing_in_child(self, jobs):  # noqa: ANN001, ANN202
        if os.getpid() != parent:
            raise RuntimeError("the helper fails")
        return real_encode(self, jobs)

    monkeypatch.setattr(forked, "beside", beside)
    sent = capture_sends(monkeypatch, lambda batch: bytes(batch.data))
    clusters = [random_cluster(random.Random(5), 80), uniform_cluster(120, 10)]
    for mode in ("here", "helper", "failing helper"):
        monkeypatch.setattr(nft_bulk, "_ELEMENTS_BESIDE", 1 << 40 if mode == "here" else 0)
        monkeypatch.setattr(nft_bulk._Compiler, "encode", failing_in_child if mode == "failing helper" else real_encode)
        for state in clusters:
            with netns.throwaway("nfp-beside") as ns:
                _proxier(ns, bulk=True).sync(state)
    third = len(sent) // 3
    assert third >= 2 and len(sent) == 3 * third
    assert sent[:third] == sent[third:2 * third] == sent[2 * third:]
    assert helpers.count(True) == 2 * third  # every batch of the helper modes had one


def test_a_full_sync_is_freed_by_reference_counts(netns: str) -> None:
    """The proxier frees a sync without a cyclic collection (a collection walks the model), and
    an idle daemon may never run one: a cycle through the batch compiler (its rule templates
    held its bound method) kept the whole full-sync transaction alive, 35 MiB of the idle
    daemon's 166 at 10 000 x 10 (bench/idle.py)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        with Proxier("nft", netns=netns, families=(IPFamily.V4,)) as proxier:
            assert proxier.sync(random_cluster(random.Random(3), 40)).kind == "full"
            alive = [o for o in gc.get_objects() if isinstance(o, (nft_bulk._Compiler, Transaction))]
            assert alive == []
    finally:
        gc.enable()
