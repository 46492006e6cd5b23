#!/usr/bin/env python3
"""Rule-changing nft batches at the kernel's validation floor: which layout gets there?

Any batch that adds a rule with a verdict, lookup or NAT expression (or a verdict-map element
that jumps) makes the commit validate the whole table: `nf_tables_validate` walks every base
chain and, through the `service-ips` verdict map, every service chain (`nft_table_validate` ->
`nft_chain_validate` -> `nft_setelem_validate`). That is what is left of a one-service change at
10 000 services. This bench measures, with real kernel batches in throwaway namespaces, three ways
past it (rule text generated here, in nfproxy's layout "s": docs/nft-layouts.md):

  a  today's layout, one table: an endpoint-count change rewrites the service chain's
     `dnat ip to numgen random mod N offset K map @endpoints-m` rule (flush + 2 rules + elements).
  b  the same, with the per-service chains, their `service-ips` dispatch map and their endpoint
     maps sharded over T tables `nfp-0` .. `nfp-(T-1)` (each with its own nat prerouting/output
     base chains, priority -100+k); masquerading, hairpin set and postrouting stay in table
     `nfproxy`. A change validates one shard only. Costs: T base chains on a connection's first
     packet (nat hooks stop at the first chain that NATs), a bigger cold start.
  c  one table, endpoint count out of the rule: every endpoint-selecting chain draws
     `numgen random mod W offset K` with a FIXED W = 67 026 960 (divisible by every N <= 16, so
     N equal buckets are exact; 64 chains x W fit a 32-bit map) and looks the draw up in an
     INTERVAL data map (`flags interval`): endpoint j owns [K + j*W/N, K + (j+1)*W/N). A count
     change deletes the N intervals and adds the N+1 new ones: element-only, no validation.

Also (d): the same fact as a verdict-map element with `goto` (service-ips, no-endpoint-*) and as
a plain set element looked up by one static rule.

Every change is compiled by nfproxy's batch compiler (interval elements are encoded here, as they
were before it had an interval vocabulary), encoded once, and sent as one nfnetlink batch on a bare netlink
socket, so only the kernel's work is timed: median and min of --repeat, alternating the change
and its undo (adds that mark the table for validation are timed without their undo). Connection
cost: a listener on 10.99.0.1:8080 in the namespace, the probed services' endpoints pointed at
it, and --connections TCP connects (SO_LINGER 0) from the namespace to the VIPs (nat output),
the two probes interleaved: first vs last shard (b), a hash-map vs an interval-map service in one
table (a vs c). Traffic: layout c with listeners per endpoint, through an element-only count
change and an empty map (the chi-square p-values should not be tiny).

    sudo .venv/bin/python bench/nft_floor.py                       # everything, ~10 min on 2 busy cores
    sudo .venv/bin/python bench/nft_floor.py --only change --sizes 100,10000
    sudo .venv/bin/python bench/nft_floor.py --only traffic       # layout c with real connections
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import struct
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The synthetic cluster's addresses and chain names: the same as the layout bench's.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nft_layouts import ep_ip, svc_chain, vip  # noqa: E402
from nfproxy.kernel import netns, nft_bulk, nft_wire  # noqa: E402
from nfproxy.kernel.nfnetlink.messages import _FAMILIES, _data, _ElemListMsg, build  # noqa: E402
from nfproxy.kernel.nfnetlink.values import NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, Message  # noqa: E402
from nfproxy.kernel.nft_netlink import NetlinkNft  # noqa: E402
from nfproxy.nftables import Chain, Element, Rule, Transaction  # noqa: E402

from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_DELSETELEM, NFT_MSG_NEWSETELEM  # noqa: E402
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NLA_F_NESTED  # noqa: E402
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_NFTABLES, nfgen_msg  # noqa: E402

MARK = 0x4000
CLUSTER_CIDR = "10.0.0.0/8"
SLOTS = 16  # layout a/b: slot block per service
PER_MAP = 64  # services per endpoints map
W = 67_026_960  # layout c: fixed modulus, = 720720 * 93, divisible by 1..16; 64 * W < 2**32
assert all(W % n == 0 for n in range(1, 17)) and PER_MAP * W < 2**32
MAIN = "nfproxy"
PROBE_IP = "10.99.0.1"


class Layout:
    """Where service i lives: its table, its map, its slot (a/b) or offset (c)."""

    def __init__(self, shards: int, interval: bool, mixed: bool = False) -> None:
        self.shards, self._interval, self.mixed = shards, interval, mixed

    def is_interval(self, i: int) -> bool:
        """`mixed`: even maps hash (a/b), odd maps interval (c), to compare lookups in one run."""
        return self._interval or (self.mixed and self.local(i) // PER_MAP % 2 == 1)

    def table(self, i: int) -> str:
        return MAIN if self.shards == 1 else f"nfp-{i % self.shards}"

    def local(self, i: int) -> int:
        return i // self.shards

    def map(self, i: int) -> str:
        return f"endpoints-{self.local(i) // PER_MAP}"

    def base(self, i: int) -> int:
        j = self.local(i)
        return (j % PER_MAP) * W if self.is_interval(i) else (j % PER_MAP) * SLOTS

    def dnat(self, i: int, n: int) -> str:
        mod = W if self.is_interval(i) else n
        return f"meta l4proto tcp dnat ip to numgen random mod {mod} offset {self.base(i)} map @{self.map(i)}"

    def buckets(self, i: int, ips: list[str]) -> list[tuple[str, str]]:
        """(key, value) elements of service i's endpoint map entries."""
        k, n = self.base(i), len(ips)
        if not self.is_interval(i):
            return [(str(k + j), f"{ip} . 8080") for j, ip in enumerate(ips)]
        return [(f"{k + j * W // n}-{k + (j + 1) * W // n - 1}", f"{ip} . 8080") for j, ip in enumerate(ips)]


def frame(t: str, priority: int | None, with_post: bool) -> str:
    """A table's static part. Shards have no postrouting (table nfproxy does it for all)."""
    T = f"ip {t}"
    out = [f"add table {T}\n"]
    if priority is not None:
        out += [
            f"add chain {T} nat-prerouting {{ type nat hook prerouting priority {priority} ; }}\n",
            f"add chain {T} nat-output {{ type nat hook output priority {priority} ; }}\n",
            f"add chain {T} services\n",
            f"add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; }}\n",
            f"add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips\n",
            f"add rule {T} nat-prerouting jump services\n",
            f"add rule {T} nat-output jump services\n",
        ]
    if priority is not None:
        out.append(f"add set {T} no-endpoint-reject {{ type ipv4_addr . inet_proto . inet_service ; }}\n")
    out += [f"add chain {T} mark-for-masquerade\n", f"add rule {T} mark-for-masquerade meta mark set meta mark or {MARK:#x}\n"]
    if with_post:
        out += [
            f"add chain {T} nat-postrouting {{ type nat hook postrouting priority 100 ; }}\n",
            f"add chain {T} masquerading\n",
            f"add set {T} hairpin {{ type ipv4_addr . ipv4_addr ; }}\n",
            f"add rule {T} masquerading meta mark and {MARK:#x} == 0 return\n",
            f"add rule {T} masquerading meta mark set meta mark xor {MARK:#x}\n",
            f"add rule {T} masquerading masquerade fully-random\n",
            f"add rule {T} nat-postrouting ct status dnat ip saddr . ip daddr @hairpin jump mark-for-masquerade\n",
            f"add rule {T} nat-postrouting jump masquerading\n",
        ]
    return "".join(out)


def ruleset(lay: Layout, services: int, n: int) -> str:
    """The whole ruleset as one `nft -f` text: frames, maps, chains and rules, then elements
    (binding maps while they are still empty: see docs/nft-layouts.md)."""
    head, rules, elements = [], [], []
    if lay.shards == 1:
        head.append(frame(MAIN, -100, True))
    else:
        head.append(frame(MAIN, None, True))
        head += [frame(f"nfp-{k}", -100 + k, False) for k in range(lay.shards)]
    maps = sorted({(lay.table(i), lay.map(i), lay.is_interval(i)) for i in range(services)})
    head += [f"add map ip {t} {m} {{ typeof numgen random mod 1 : ip daddr . tcp dport ;{' flags interval ;' if iv else ''} }}\n"
             for t, m, iv in maps]
    for i in range(services):
        T, sc = f"ip {lay.table(i)}", svc_chain(i)
        ips = [ep_ip(i, j) for j in range(n)]
        rules += [
            f"add chain {T} {sc}\n",
            f"add rule {T} {sc} ip daddr {vip(i)} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade\n",
            f"add rule {T} {sc} {lay.dnat(i, n)}\n",
        ]
        elements += [
            f"add element {T} {lay.map(i)} {{ {', '.join(f'{k} : {v}' for k, v in lay.buckets(i, ips))} }}\n",
            f"add element ip {MAIN} hairpin {{ {', '.join(f'{ip} . {ip}' for ip in ips)} }}\n",
            f"add element {T} service-ips {{ {vip(i)} . tcp . 80 : goto {sc} }}\n",
        ]
    return "".join(head + rules + elements)


# --------------------------------------------------------------------------------------------
# Changes, each one nfnetlink batch.


def _interval_elements(lay: Layout, i: int, ips: list[str], with_values: bool) -> list[dict]:
    """Interval elements as libnftables sends them for a one-field interval map: each range is
    a start element (with its data) and an end element at end+1 flagged INTERVAL_END; keys are
    big-endian (the rule converts the numgen draw with `byteorder hton` before the lookup)."""
    out = []
    for key, value in lay.buckets(i, ips):
        lo, hi = (int(x) for x in key.split("-"))
        start: list = [("NFTA_SET_ELEM_KEY", _data(lo.to_bytes(4, "big")), NLA_F_NESTED)]
        if with_values:
            ip, port = value.split(" . ")
            data = socket.inet_aton(ip) + int(port).to_bytes(2, "big") + b"\0\0"
            start.append(("NFTA_SET_ELEM_DATA", _data(data), NLA_F_NESTED))
        out.append({"attrs": start})
        out.append({"attrs": [("NFTA_SET_ELEM_KEY", _data((hi + 1).to_bytes(4, "big")), NLA_F_NESTED),
                              ("NFTA_SET_ELEM_FLAGS", 1)]})
    return out


def _elem_msg(table: str, set_name: str, adding: bool, elements: list[dict]) -> Message:
    return Message(_ElemListMsg, NFT_MSG_NEWSETELEM if adding else NFT_MSG_DELSETELEM,
                   NLM_F_CREATE if adding else 0,
                   (("NFTA_SET_ELEM_LIST_TABLE", table), ("NFTA_SET_ELEM_LIST_SET", set_name),
                    ("NFTA_SET_ELEM_LIST_ELEMENTS", elements, NLA_F_NESTED)), f"elements of {set_name}")


def batch_bytes(messages: list[Message]) -> bytes:
    """BEGIN, the messages (each asking for an ack), END, encoded once: the timed part is then
    the kernel's alone (send, process, commit, acks), not pyroute2's encoder."""
    nfproto = _FAMILIES["ip"]
    out = bytearray()
    begin, end = nfgen_msg(), nfgen_msg()
    for seq, (m, kind) in enumerate(((begin, NFNL_MSG_BATCH_BEGIN), (end, NFNL_MSG_BATCH_END))):
        m["res_id"] = NFNL_SUBSYS_NFTABLES
        m["header"]["type"] = kind
        m["header"]["flags"] = NLM_F_REQUEST
        m["header"]["sequence_number"] = 0 if seq == 0 else len(messages) + 1
        m.encode()
    out += begin.data
    for k, message in enumerate(messages, 1):
        msg = build(message, nfproto, k)
        msg.encode()
        out += msg.data
    out += end.data
    return bytes(out)


class RawNetlink:
    """A bare NETLINK_NETFILTER socket in the namespace: send a prepared batch, count acks."""

    def __init__(self, ns: str) -> None:
        with netns.entered(ns):
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
        self.sock.bind((0, 0))

    def send(self, data: bytes, acks: int) -> None:
        self.sock.send(data)
        got = 0
        while got < acks:
            buf = self.sock.recv(1 << 16)
            off = 0
            while off < len(buf):
                length, kind = struct.unpack_from("=IH", buf, off)
                if kind == 2:  # NLMSG_ERROR: an ack (error 0) or a refusal
                    (err,) = struct.unpack_from("=i", buf, off + 16)
                    if err != 0:
                        raise RuntimeError(f"kernel refused a message: errno {-err}")
                    got += 1
                off += (length + 3) & ~3

    def close(self) -> None:
        self.sock.close()


def rule_change(lay: Layout, i: int, n: int, grow: bool) -> Transaction:
    """One endpoint added to (grow) or removed from service i: what nfproxy's partial sync
    sends today (chain rewritten with the new `mod`, the slot's element added or deleted)."""
    t, sc = lay.table(i), svc_chain(i)
    m = n + 1 if grow else n
    tx = Transaction("ip", t)
    tx.flush(Chain(sc))
    tx.add(Rule(sc, f"ip daddr {vip(i)} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"))
    tx.add(Rule(sc, lay.dnat(i, m)))
    slot = Element(lay.map(i), str(lay.base(i) + n), f"{ep_ip(i, n)} . 8080" if grow else "")
    (tx.add if grow else tx.delete)(slot)
    return tx


def element_change(lay: Layout, i: int, gen: int) -> Transaction:
    """One endpoint replaced (same count): element-only in every layout."""
    tx = Transaction("ip", lay.table(i))
    tx.delete(Element(lay.map(i), str(lay.base(i))))
    tx.add(Element(lay.map(i), str(lay.base(i)), f"{ep_ip(i, 0, gen)} . 8080"))
    return tx


def interval_change(lay: Layout, i: int, n: int, grow: bool) -> list[Message]:
    """Layout c: the count changes n <-> n+1: delete every old bucket, add every new one."""
    old = [ep_ip(i, j) for j in range(n + (0 if grow else 1))]
    new = [ep_ip(i, j) for j in range(n + (1 if grow else 0))]
    t, m = lay.table(i), lay.map(i)
    return [_elem_msg(t, m, False, _interval_elements(lay, i, old, False)),
            _elem_msg(t, m, True, _interval_elements(lay, i, new, True))]


def _median_ms(batches: list[tuple[bytes, int]], raw: RawNetlink, repeat: int, first_only: bool = False) -> tuple[float, float]:
    """Median and min ms of sending the prepared batches in turn (a change, then its undo).
    The min is what the kernel needs when it gets a CPU at once: the machine is shared.
    `first_only`: time the change, not its undo (an element delete never validates)."""
    times = []
    for k in range(len(batches) * (repeat + 1)):
        data, acks = batches[k % len(batches)]
        gc.collect()
        start = time.perf_counter()
        raw.send(data, acks)
        if k >= len(batches) and not (first_only and k % len(batches)):
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, min(times) * 1000


def _prepared(messages: list[Message]) -> tuple[bytes, int]:
    return batch_bytes(messages), len(messages)


def _compiled(nl: NetlinkNft, tx: Transaction) -> tuple[bytes, int]:
    """`tx` as nfproxy's batch compiler writes it, every message asking for an ack (RawNetlink
    counts them), framed once."""
    batch = nft_bulk.compile_batch(tx, lambda name: nl.set_type(tx.family, tx.table, name))
    data = bytearray(batch.data)
    at = 0
    while at < len(data):
        (length,) = struct.unpack_from("=I", data, at)
        (flags,) = struct.unpack_from("=H", data, at + 6)
        struct.pack_into("=H", data, at + 6, flags | NLM_F_ACK)
        at += (length + 3) & ~3
    count = len(batch.origins)
    return bytes(nft_wire.batch_begin(0) + data + nft_wire.batch_end(count + 1)), count


def _nft(ns: str, text: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True, check=True)


def _load(ns: str, text: str) -> float:
    """Cold start: libnftables in-process, one transaction (as a full sync does)."""
    import nftables

    with netns.entered(ns):
        ctx = nftables.Nftables()
    start = time.perf_counter()
    rc, _out, err = ctx.cmd(text)
    seconds = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"nft refused the ruleset: {err[:1000]}")
    return seconds


def child_change(shards: int, interval: bool, services: int, n: int, repeat: int) -> dict:
    lay = Layout(shards, interval)
    i = services // 2
    with netns.throwaway("nfp-floor") as ns:
        cold = _load(ns, ruleset(lay, services, n))
        nl, raw = NetlinkNft(ns), RawNetlink(ns)
        try:
            if interval:
                count = [_prepared(interval_change(lay, i, n, g)) for g in (True, False)]
                elem = [_prepared(_interval_replace(lay, i, n, g)) for g in (1, 0)]
            else:
                count = [_compiled(nl, (rule_change(lay, i, n, g))) for g in (True, False)]
                elem = [_compiled(nl, (element_change(lay, i, g))) for g in (1, 0)]
                nl.apply(_scratch(lay, i, add_chain=True))
                one_rule = _median_ms([_compiled(nl, (_scratch(lay, i)))], raw, repeat)
                vmap_goto = _median_ms([_compiled(nl, (_goto_element(lay, i, adding))) for adding in (True, False)], raw, repeat, True)
                nl.apply(_plain_set(lay, i))
                set_elem = _median_ms([_compiled(nl, (_set_element(lay, i, adding))) for adding in (True, False)], raw, repeat, True)
            count_ms = _median_ms(count, raw, repeat)
            elem_ms = _median_ms(elem, raw, repeat)
        finally:
            nl.close()
            raw.close()
        listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "map", "ip", lay.table(i), lay.map(i)],
                                capture_output=True, text=True, check=True).stdout
    res = {"cold_s": cold, "count_ms": count_ms[0], "count_min_ms": count_ms[1], "elem_ms": elem_ms[0],
           "elem_min_ms": elem_ms[1],
           "listed_elements": listed.count(" : ")}
    if not interval:
        res.update(one_rule_ms=one_rule[0], one_rule_min_ms=one_rule[1], goto_ms=vmap_goto[0], goto_min_ms=vmap_goto[1],
                   set_ms=set_elem[0], set_min_ms=set_elem[1])
    return res


def _goto_element(lay: Layout, i: int, adding: bool) -> Transaction:
    """A verdict-map element that jumps (a service port added, or `no-endpoint-services`'
    `goto reject-chain`): the kernel marks the table for validation, as for a rule."""
    tx = Transaction("ip", lay.table(i))
    el = Element("service-ips", f"{vip(i)} . tcp . 81", f"goto {svc_chain(i)}" if adding else "")
    (tx.add if adding else tx.delete)(el)
    return tx


def _plain_set(lay: Layout, i: int) -> Transaction:
    """A plain set and one static rule using it (created once, outside the timing)."""
    tx = Transaction("ip", lay.table(i))
    tx.add(Chain("scratch2"))
    tx.add(Rule("scratch2", "ip daddr . meta l4proto . th dport @no-endpoint-reject drop"))
    return tx


def _set_element(lay: Layout, i: int, adding: bool) -> Transaction:
    """The same fact as a plain set element (`ip daddr . meta l4proto . th dport @S reject`):
    no verdict in the element, no validation."""
    tx = Transaction("ip", lay.table(i))
    (tx.add if adding else tx.delete)(Element("no-endpoint-reject", f"{vip(i)} . tcp . 81"))
    return tx


def _scratch(lay: Layout, i: int, add_chain: bool = False) -> Transaction:
    tx = Transaction("ip", lay.table(i))
    if add_chain:
        tx.add(Chain("scratch"))
    tx.flush(Chain("scratch"))
    tx.add(Rule("scratch", "ip daddr 1.2.3.4 drop"))
    return tx


def _interval_replace(lay: Layout, i: int, n: int, gen: int) -> list[Message]:
    """Layout c: endpoint 0 replaced, count kept: its bucket deleted and re-added."""
    t, m = lay.table(i), lay.map(i)
    ips = [ep_ip(i, 0, gen)] + [ep_ip(i, j) for j in range(1, n)]
    return [_elem_msg(t, m, False, _interval_elements(lay, i, ips, False)[:2]),
            _elem_msg(t, m, True, _interval_elements(lay, i, ips, True)[:2])]


# --------------------------------------------------------------------------------------------
# First-connection cost through T nat base chains.


def child_conn(shards: int, kind: str, services: int, n: int, connections: int) -> dict:
    """Two probed services, connected to in turn: the first and the last shard (hash maps), or
    (`mixed`, one table) a service in a hash map and one in an interval map."""
    lay = Layout(shards, kind == "interval", mixed=kind == "mixed")
    first, last = (0, PER_MAP) if kind == "mixed" else (0, shards - 1)
    with netns.throwaway("nfp-floor") as ns:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{PROBE_IP}/32", "dev", "lo"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "route", "add", "local", "172.30.0.0/16", "dev", "lo"], check=True)
        _load(ns, ruleset(lay, services, n))
        for i in (first, last):
            T, m = f"ip {lay.table(i)}", lay.map(i)
            keys = [k for k, _v in lay.buckets(i, [ep_ip(i, j) for j in range(n)])]
            _nft(ns, f"delete element {T} {m} {{ {', '.join(keys)} }}\n"
                     f"add element {T} {m} {{ {', '.join(f'{k} : {PROBE_IP} . 8080' for k in keys)} }}\n")
        with netns.entered(ns):
            srv = socket.socket()
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((PROBE_IP, 8080))
            srv.listen(4096)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                c.close()

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        times: dict[int, list[float]] = {first: [], last: []}
        linger = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")
        try:
            with netns.entered(ns):
                for k in range(2 * connections):
                    i = first if k % 2 == 0 else last
                    s = socket.socket()
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    start = time.perf_counter()
                    s.connect((vip(i), 80))
                    times[i].append(time.perf_counter() - start)
                    s.close()
        finally:
            stop.set()
            srv.close()
    f, l = statistics.median(times[first]) * 1e6, statistics.median(times[last]) * 1e6
    return {"first_us": f, "last_us": l, "per_chain_ns": (l - f) / max(1, shards - 1) * 1000 if shards > 1 else 0.0}


# --------------------------------------------------------------------------------------------
# Layout c with real connections: uniform over N, count changes element-only, N = 0 falls through.


def _chi2_p(counts: list[int]) -> float:
    """p-value of a chi-square test of uniformity (scipy-free: regularized gamma by series)."""
    import math

    total, k = sum(counts), len(counts)
    x = sum((c - total / k) ** 2 / (total / k) for c in counts)
    a, s = (k - 1) / 2, x / 2
    term = summ = 1 / a
    for n in range(1, 500):
        term *= s / (a + n)
        summ += term
    return max(0.0, 1 - math.exp(-s + a * math.log(s) - math.lgamma(a)) * summ) if s > 0 else 1.0


def child_traffic(per_endpoint: int) -> dict:
    lay, i, services = Layout(1, interval=True), 5, 64  # offset 5 W; neighbours' buckets adjacent
    local = [f"10.99.0.{j + 1}" for j in range(4)]
    found: dict[str, object] = {}
    with netns.throwaway("nfp-floor") as ns:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        for ip in local:
            subprocess.run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "route", "add", "local", "172.30.0.0/16", "dev", "lo"], check=True)
        _load(ns, ruleset(lay, services, 10))
        hits: Counter[str] = Counter()
        servers = []
        with netns.entered(ns):
            for ip in local:
                srv = socket.socket()
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind((ip, 8080))
                srv.listen(4096)
                servers.append(srv)

        def serve(srv: socket.socket) -> None:
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                hits[c.getsockname()[0]] += 1
                c.close()

        for srv in servers:
            threading.Thread(target=serve, args=(srv,), daemon=True).start()
        raw = RawNetlink(ns)

        def change(old: list[str], new: list[str]) -> None:
            msgs = []
            if old:
                msgs.append(_elem_msg(MAIN, lay.map(i), False, _interval_elements(lay, i, old, False)))
            if new:
                msgs.append(_elem_msg(MAIN, lay.map(i), True, _interval_elements(lay, i, new, True)))
            raw.send(batch_bytes(msgs), len(msgs))

        def connect(count: int) -> tuple[dict[str, int], int]:
            hits.clear()
            refused = 0
            with netns.entered(ns):
                for _ in range(count):
                    s = socket.socket()
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + (0).to_bytes(4, "little"))
                    try:
                        s.connect((vip(i), 80))
                    except ConnectionRefusedError:
                        refused += 1
                    s.close()
            time.sleep(0.2)  # let the accept threads count the last ones
            return dict(sorted(hits.items())), refused

        try:
            change([ep_ip(i, j) for j in range(10)], local[:3])
            found["3 endpoints"] = connect(3 * per_endpoint)
            change(local[:3], local)
            found["4 endpoints (element-only change)"] = connect(4 * per_endpoint)
            change(local, [])
            found["0 endpoints (no element: the rule does not match)"] = connect(50)
            change([], local[:2])
            found["2 endpoints again"] = connect(2 * per_endpoint)
        finally:
            raw.close()
            for srv in servers:
                srv.close()
    return {k: {"hits": h, "refused": r, "chi2_p": _chi2_p(list(h.values())) if len(h) > 1 else None} for k, (h, r) in found.items()}


# --------------------------------------------------------------------------------------------


def run_child(*args: str, timeout: float = 1800) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ms(r: dict, key: str) -> str:
    return f"{r[key + '_ms']:.2f} ({r[key + '_min_ms']:.2f})" if key + "_ms" in r else "—"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,10000")
    ap.add_argument("--shards", default="16,64,256")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--connections", type=int, default=3000)
    ap.add_argument("--only", default="change,conn,traffic")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.endpoints
    if args.child:
        kind, *rest = args.child
        if kind == "change":
            res = child_change(int(rest[0]), rest[1] == "interval", int(rest[2]), n, args.repeat)
        elif kind == "conn":
            res = child_conn(int(rest[0]), rest[1], int(rest[2]), n, args.connections)
        else:
            res = child_traffic(int(rest[0]))
        print(json.dumps(res))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    shards = [int(s) for s in args.shards.split(",")]
    big = max(sizes)
    only = set(args.only.split(","))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {n} endpoints per service")
    if "change" in only:
        print(f"\nOne batch each, ms: median of {2 * args.repeat} (min)")
        print("| layout | services | cold start s | endpoint count change | one-rule batch | pod replaced "
              "| vmap element with goto | plain set element |")
        print("|---|---|---|---|---|---|---|---|")
        cells = [("a one table", 1, "hash", s) for s in sizes]
        cells += [(f"b {t} shard tables", t, "hash", big) for t in shards]
        cells += [("c fixed modulus, interval map", 1, "interval", s) for s in sizes]
        for label, t, kind, s in cells:
            r = run_child("change", str(t), kind, str(s), "--repeat", str(args.repeat))
            if "error" in r:
                print(f"| {label} | {s} | {r['error']} |", flush=True)
                continue
            print(f"| {label} | {s} | {r['cold_s']:.2f} | {_ms(r, 'count')} | {_ms(r, 'one_rule')} | {_ms(r, 'elem')} "
                  f"| {_ms(r, 'goto')} | {_ms(r, 'set')} |", flush=True)
    if "conn" in only:
        print(f"\nTCP connect() to a VIP from the namespace (nat output), median of {args.connections}, µs, {big} services")
        print("| layout: service A / service B | A µs | B µs | (B - A) per extra base chain, ns |")
        print("|---|---|---|---|")
        for t, kind in [(1, "mixed"), *((t, "hash") for t in shards)]:
            r = run_child("conn", str(t), kind, str(big), "--connections", str(args.connections))
            label = ("1 table: in a hash map (a) / in an interval map (c)" if kind == "mixed"
                     else f"{t} tables (b): in the first table / in the last")
            if "error" in r:
                print(f"| {label} | {r['error']} |", flush=True)
                continue
            per = "—" if kind == "mixed" else f"{r['per_chain_ns']:.0f}"
            print(f"| {label} | {r['first_us']:.1f} | {r['last_us']:.1f} | {per} |", flush=True)
    if "traffic" in only:
        r = run_child("traffic", "300")
        print("\nLayout c with real connections (service 5 of 64 in one interval map; chi-square p of uniformity):")
        for k, v in r.items():
            print(f"- {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
