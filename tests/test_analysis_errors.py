"""Bad dumps and hard ones: clean errors naming file and line, bounded work, both families.

Issue J's cases one by one (out-of-range probabilities, binary input, a missing file, a dump cut
short, crashing JSON shapes, an IPv4 packet against IPv6-only rules, render output holding both
families), the two inputs that used to run forever (40 chains of two rules, numgen mod 2^32 and
2^64), the indexes that make lookups constant-time (the same answers as a linear scan), and
K's start-up rule (no kubernetes client for commands that do not talk to the API server).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from nfproxy.analysis import dump, iptables_save, nft_json
from nfproxy.analysis.check import check
from nfproxy.analysis.index import ElementIndex, key_matches
from nfproxy.analysis.interpret import Outcome, Packet, interpret, trace
from nfproxy.analysis.ir import Const, Element, Prefix, Range
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.cli.commands.render import render_text
from nfproxy.cli.main import main
from nfproxy.core.model import IPFamily, NodeConfig
from nfproxy.sources import manifests

ROOT = Path(__file__).resolve().parent.parent
DUMPS = Path(__file__).resolve().parent / "dumps"
STATE = manifests.load(str(ROOT / "examples"), NodeConfig()).state
SAVE = (DUMPS / "kube-proxy-iptables-save.txt").read_text()
CASCADE_LINE = next(i for i, line in enumerate(SAVE.splitlines(), 1) if "--probability" in line)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("probability", ["1.5", "-0.1", "NaN", "inf"])
@pytest.mark.parametrize("command", ["check", "trace"])
def test_bad_probability_is_an_error_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   probability: str, command: str) -> None:
    lines = SAVE.splitlines()
    original = lines[CASCADE_LINE - 1].split("--probability ")[1].split()[0]
    lines[CASCADE_LINE - 1] = lines[CASCADE_LINE - 1].replace(f"--probability {original}", f"--probability {probability}")
    path = tmp_path / "save.txt"
    path.write_text("\n".join(lines) + "\n")
    extra = ["10.0.1.1", "172.30.0.41:80/tcp"] if command == "trace" else []
    code, _, err = run(capsys, command, "--from-file", str(path), *extra)
    assert code == 2
    assert err.startswith(f"nfproxy: error: {path}:{CASCADE_LINE}: ") and "outside [0, 1]" in err


@pytest.mark.parametrize("command", ["check", "trace"])
def test_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    extra = ["10.0.1.1", "172.30.0.41:80/tcp"] if command == "trace" else []
    binary = tmp_path / "binary"
    binary.write_bytes(b"*nat\n\xff\xfe\x00garbage\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.txt"
    big.write_text(SAVE)
    expected = {
        str(tmp_path / "missing"): "cannot read: No such file",
        str(binary): "2: not UTF-8 text",
        str(fifo): "a FIFO, not a regular file",  # opening it would block for ever
        str(zero): "a device or socket, not a regular file",
        str(tmp_path): "a directory",
    }
    for path, message in expected.items():
        code, _, err = run(capsys, command, "--from-file", path, *extra)
        assert code == 2 and err.startswith(f"nfproxy: error: {path}:") and message in err, err
    code, _, err = run(capsys, command, "--from-file", str(big), "--max-dump-bytes", "1000", *extra)
    assert code == 2 and "more than the limit of 1000" in err


def test_dump_cut_mid_table_is_not_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Truncated inside *nat: before, some cuts read as a smaller, clean ruleset (exit 0)."""
    text = iptables_backend.render(STATE, IPFamily.V4).restore_text(with_jumps=True)
    lines = text.splitlines()
    nat = lines.index("*nat")
    for cut in range(nat + 1, len(lines) - 1, max(1, (len(lines) - nat) // 24)):
        path = tmp_path / "cut.txt"
        path.write_text("\n".join(lines[:cut]) + "\n")
        code, out, err = run(capsys, "check", "--from-file", str(path))
        assert code == 2 and "no problems found" not in out
        assert f"{path}:{cut}: *nat (line {nat + 1}) has no COMMIT" in err


JSON_SHAPES = [
    {"nftables": [{"rule": {"family": "ip", "table": "t", "expr": []}}]},  # KeyError 'chain'
    {"nftables": [{"chain": {"family": "ip", "table": "t", "name": ["x"]}}]},  # unhashable name
    {"nftables": [{"rule": "text"}]},  # AttributeError on a string
    {"nftables": [{"table": {"family": 4, "name": "t"}}]},
    {"nftables": [{"map": {"family": "ip", "table": "t", "name": "m", "type": "ipv4_addr", "map": "verdict",
                           "elem": [[1, 2, 3]]}}]},
    {"nftables": [{"rule": {"family": "ip", "table": "t", "chain": "c", "expr": {"not": "a list"}}}]},
    {"nftables": [{"chain": {"family": "ip", "table": "t", "name": "c", "hook": "prerouting", "prio": "high"}}]},
]


@pytest.mark.parametrize("shape", range(len(JSON_SHAPES)))
@pytest.mark.parametrize("command", ["check", "trace"])
def test_malformed_json_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: int, command: str) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(JSON_SHAPES[shape]))
    extra = ["10.0.1.1", "172.30.0.41:80/tcp"] if command == "trace" else []
    code, _, err = run(capsys, command, "--from-file", str(path), *extra)
    assert code == 2 and err.startswith(f"nfproxy: error: {path}: "), err
    assert "nftables[0]" in err or "chain 'c'" in err


def test_a_statement_of_the_wrong_shape_is_not_understood(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Inside a rule, a malformed statement is Unknown: on a packet's path it is an error naming
    the rule, never a guess (and never a crash)."""
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"nftables": [
        {"chain": {"family": "ip", "table": "t", "name": "c", "hook": "prerouting", "type": "nat", "prio": -100}},
        {"rule": {"family": "ip", "table": "t", "chain": "c", "expr": [{"jump": {"target": [1]}}]}}]}))
    code, _, err = run(capsys, "trace", "--from-file", str(path), "10.0.1.1", "172.30.0.41:80/tcp")
    assert code == 2 and err.startswith(f"nfproxy: error: {path}: ip t: chain c rule 1: unsupported")


def test_deep_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"nftables": [' + "[" * 200_000 + "]" * 200_000 + "]}")
    code, _, err = run(capsys, "check", "--from-file", str(path))
    assert code == 2 and "nested too deeply" in err
    path.write_text('{"nftables": [{"rule": {"family": "ip", "table": "t", "chain": "c", "expr": [{"match": '
                    '{"op": "==", "left": ' + '{"concat": [' * 5000 + "1" + "]}" * 5000 + ', "right": 1}}]}}]}')
    code, _, err = run(capsys, "check", "--from-file", str(path))
    assert code == 2 and f"{path}:" in err


def test_render_output_holds_both_families(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`render --backend iptables` prints IPv4 then IPv6: an IPv4 packet is answered from the
    IPv4 tables (it used to be read as IPv6 and answered ACCEPT, with no steps)."""
    path = tmp_path / "render.txt"
    path.write_text(render_text("iptables", STATE))
    assert {t.family for t in dump.read_file(str(path)).ruleset.tables} == {"ip", "ip6"}
    code, out, _ = run(capsys, "trace", "--from-file", str(path), "10.244.0.5", "10.96.10.40:80/tcp")
    assert code == 0 and "DNAT 10.244.0.41:8080  p = 1/2" in out and "KUBE-SERVICES" in out


_SCRIPT_HEAD = "add table ip nfproxy\nadd chain ip nfproxy c { type nat hook prerouting priority -100 ; }\n"
_SET = "add set ip nfproxy s { type ipv4_addr ; }\n"
NFT_SCRIPTS = [  # (script, line, message): `nfproxy render --backend nft` text a reader refuses
    (_SCRIPT_HEAD + _SET + "add element ip nfproxy s {\nbogus\n}\n", 5, "'bogus' does not appear to be an IPv4"),
    (_SCRIPT_HEAD + _SET + "add element ip nfproxy s {\n0x\n}\n", 5, "invalid literal for int()"),
    (_SCRIPT_HEAD + "add set ip nfproxy s { type ipv4_addr ; flags interval ; }\nadd element ip nfproxy s {\n10.0.0.0/8/8\n}\n",
     5, "too many values"),
    ("add table ip nfproxy\nadd chain ip nfproxy c { type nat hook postrouting priority foo ; }\n", 2, "'foo'"),
    (_SCRIPT_HEAD + "add rule ip nfproxy c meta mark and 0x4000\n", 3, "outside the JSON vocabulary"),
    (_SCRIPT_HEAD + "add rule ip nfproxy c numgen random mod 1e400 vmap { 0 : drop }\n", 3, "'1e400'"),
    (_SCRIPT_HEAD + "add rule ip nfproxy c ip daddr { { 1.2.3.4 } } accept\n", 3, "not supported"),
    (_SCRIPT_HEAD + _SET + "add element ip nfproxy s {\n1.2.3.4\n", 4, "never closed"),
    # What nft refuses: a DNAT port past 16 bits (in a rule, in an endpoint map's data), a hook
    # it does not know. The reader took the port as it came and left the bogus chain out.
    (_SCRIPT_HEAD + "add rule ip nfproxy c dnat ip to 10.0.0.1:99999\n", 3, "port 99999 out of range (0-65535)"),
    (_SCRIPT_HEAD + "add map ip nfproxy m { typeof numgen random mod 1 : ip daddr . tcp dport ; }\n"
     "add rule ip nfproxy c meta l4proto tcp dnat ip to numgen random mod 1 map @m\n"
     "add element ip nfproxy m {\n0 : 10.0.0.1 . 70000\n}\n",
     6, "element 0: port 70000 out of range"),
    ("add table ip nfproxy\nadd chain ip nfproxy c { type nat hook bogus priority -100 ; }\n", 2, "hook 'bogus' is not one of"),
    # The declaration names a set's types, not a later `flush set` of it (the line used to be
    # that of the first element of any concatenated set before the culprit).
    (_SCRIPT_HEAD + "add set ip nfproxy p { type ipv4_addr . ipv4_addr ; }\nflush set ip nfproxy p\n"
     "add element ip nfproxy p {\n1.2.3.4 . 1.2.3.4\n}\n" + _SET + "add element ip nfproxy s {\nbogus\n}\n",
     10, "'bogus' does not appear to be an IPv4"),
]


@pytest.mark.parametrize("case", range(len(NFT_SCRIPTS)))
@pytest.mark.parametrize("command", ["check", "trace"])
def test_a_malformed_nft_script_is_an_error_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int, command: str
) -> None:
    text, line, message = NFT_SCRIPTS[case]
    path = tmp_path / "rules.nft"
    path.write_text(text)
    extra = ["10.0.1.1", "172.30.0.41:80/tcp"] if command == "trace" else []
    code, _, err = run(capsys, command, "--from-file", str(path), *extra)
    assert code == 2 and err.startswith(f"nfproxy: error: {path}:{line}: ") and message in err, err
    assert err.count("\n") == 1


def test_a_packet_list_gets_the_checks_of_a_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump_path = str(DUMPS / "kube-proxy-iptables-save.txt")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block for ever
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")  # reading it would never end
    binary = tmp_path / "binary"
    binary.write_bytes(b"10.0.1.1 172.30.0.41:80/tcp\n\xff\xfe bad\n")
    expected = {fifo: "a FIFO, not a regular file", zero: "a device or socket, not a regular file",
                binary: "2: not UTF-8 text"}
    for path, message in expected.items():
        code, out, err = run(capsys, "trace", "--from-file", dump_path, "--packets", str(path))
        assert code == 2 and not out and err.startswith(f"nfproxy: error: {path}:") and message in err, err


@pytest.mark.parametrize("position", ["0", "99999999999999999999", "3"])
def test_an_insert_at_no_position_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], position: str) -> None:
    """iptables refuses `-I CHAIN 0` and an index past the end; the reader did `list.insert`
    (0 became the last but one, a huge one an OverflowError)."""
    path = tmp_path / "save.txt"
    path.write_text(f"*nat\n:PREROUTING ACCEPT [0:0]\n:C - [0:0]\n-A C -j RETURN\n-I C {position} -j DROP\nCOMMIT\n")
    code, _, err = run(capsys, "check", "--from-file", str(path))
    assert code == 2 and err.startswith(f"nfproxy: error: {path}:5: -I C {position}: no such position"), err


@pytest.mark.parametrize("port", ["65536", "99999"])
def test_a_dnat_port_past_16_bits_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], port: str) -> None:
    """iptables-restore refuses it (`Port '99999' not valid`): check used to report a service
    with an endpoint 10.1.0.1:99999 and "no problems found"."""
    path = tmp_path / "save.txt"
    path.write_text("*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-A - [0:0]\n-A PREROUTING -j KUBE-SVC-A\n"
                    f"-A KUBE-SVC-A -p tcp -m tcp -j DNAT --to-destination 10.1.0.1:{port}\nCOMMIT\n")
    code, out, err = run(capsys, "check", "--from-file", str(path))
    assert code == 2 and not out and err.startswith(f"nfproxy: error: {path}:5: Port `{port}' not valid"), err


def test_a_json_dump_with_what_nft_never_lists_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = '{"nftables": [{"table": {"family": "ip", "name": "t"}}, '
    chain = '{"chain": {"family": "ip", "table": "t", "name": "c", "type": "nat", "hook": "%s", "prio": -100}}'
    cases = {
        chain % "bogus" + "]}": "chain 'c': hook 'bogus' is not one of",
        chain % "prerouting" + ', {"rule": {"family": "ip", "table": "t", "chain": "c", "expr": '
        '[{"dnat": {"addr": "10.0.0.1", "port": 65536}}]}}]}': "port 65536 out of range",
        chain % "prerouting" + ', {"map": {"family": "ip", "table": "t", "name": "m", "type": "ipv4_addr", '
        '"map": ["ipv4_addr", "inet_service"], "elem": [["1.2.3.4", {"concat": ["10.0.0.1", 99999]}]]}}]}':
            "(map 'm'): element 1.2.3.4: port 99999 out of range",
    }
    path = tmp_path / "dump.json"
    for doc, message in cases.items():
        path.write_text(head + doc)
        code, _, err = run(capsys, "check", "--from-file", str(path))
        assert code == 2 and err.startswith(f"nfproxy: error: {path}: ") and message in err, err


def test_an_infinite_priority_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dump.json"
    path.write_text('{"nftables": [{"table": {"family": "ip", "name": "t"}}, '
                    '{"chain": {"family": "ip", "table": "t", "name": "c", "prio": 1e999}}]}')
    code, _, err = run(capsys, "check", "--from-file", str(path))
    # Refused as nft's JSON reader refuses it, before any object is read: the place is its line.
    assert code == 2 and err.startswith(f"nfproxy: error: {path}:1: 1e999 is past the largest double"), err


V6_POLICIES = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"


def test_concatenated_saves_are_told_apart_by_their_headers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`iptables-save > f; ip6tables-save >> f`: the second save has no address to tell its
    family by, only its header; merged into IPv4, its FORWARD DROP made every answer a drop."""
    path = tmp_path / "both.txt"
    path.write_text(SAVE + "# Generated by ip6tables-save v1.8.9 (nf_tables)\n" + V6_POLICIES)
    alone = tmp_path / "v4.txt"
    alone.write_text(SAVE)
    argv = ("trace", "--json", "10.0.1.1", "172.30.0.41:80/tcp")
    code, out, err = run(capsys, argv[0], "--from-file", str(path), *argv[1:])
    code_alone, out_alone, _ = run(capsys, argv[0], "--from-file", str(alone), *argv[1:])
    assert code == code_alone == 0, err
    assert json.loads(out)["paths"] == json.loads(out_alone)["paths"]

    path.write_text(SAVE + V6_POLICIES)  # no header: which family is it?
    code, out, err = run(capsys, "check", "--from-file", str(path))
    line = SAVE.count("\n") + 1
    assert code == 2 and err.startswith(f"nfproxy: error: {path}:{line}: *filter again for IPv4 (first at line "), err


def test_a_byte_order_mark_is_not_part_of_the_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dump.json"
    path.write_text("\ufeff" + json.dumps({"nftables": [{"table": {"family": "ip", "name": "t"}}]}))
    code, out, err = run(capsys, "check", "--from-file", str(path))
    assert code == 0 and "no problems found" in out, err


def test_random_mode_without_a_probability_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """iptables-restore refuses it; read as "always matches" it hid a cascade's split."""
    lines = SAVE.splitlines()
    original = lines[CASCADE_LINE - 1].split("--probability ")[1].split()[0]
    lines[CASCADE_LINE - 1] = lines[CASCADE_LINE - 1].replace(f" --probability {original}", "")
    path = tmp_path / "save.txt"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run(capsys, "check", "--from-file", str(path))
    assert code == 2 and err.startswith(f"nfproxy: error: {path}:{CASCADE_LINE}: -m statistic --mode random without --probability")


def test_trace_refuses_a_family_the_dump_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(DUMPS / "kube-proxy-iptables-save.txt")
    code, out, err = run(capsys, "trace", "--from-file", path, "fd00::1", "[fd00::10]:80/tcp")
    assert code == 2 and not out
    assert err.startswith(f"nfproxy: error: {path}: holds no IPv6 rules")


def test_trace_many_packets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    packets = tmp_path / "packets"
    packets.write_text("# src dst [origin]\n10.0.1.1 172.30.0.41:80/tcp\n\nnonsense\n192.168.0.2 172.30.0.41:80/tcp node\n")
    code, out, err = run(capsys, "trace", "--json", "--from-file", str(DUMPS / "kube-proxy-iptables-save.txt"),
                         "--node-ip", "192.168.0.2", "--packets", str(packets))
    answers = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and err == f"nfproxy: error: {packets}:4: expected SRC DST:PORT/PROTO [ORIGIN], got 'nonsense'\n"
    assert [a["packet"]["origin"] for a in answers] == ["pod", "node"]
    assert all(sum(Fraction(p["probability"]) for p in a["paths"]) == 1 for a in answers)


def cascade(chains: int) -> str:
    lines = ["*nat", ":PREROUTING ACCEPT [0:0]"] + [f":C{i} - [0:0]" for i in range(chains + 1)]
    lines.append("-A PREROUTING -j C0")
    for i in range(chains):
        lines.append(f"-A C{i} -m statistic --mode random --probability 0.5 -j C{i + 1}")
        lines.append(f"-A C{i} -j C{i + 1}")
    lines += [f"-A C{chains} -p tcp -j DNAT --to-destination 10.0.0.1:80", "COMMIT", ""]
    return "\n".join(lines)


def test_forty_chains_of_two_rules() -> None:
    """2^40 paths, walked as 80 rules: each chain is walked once per state."""
    rs = iptables_save.parse(cascade(40), 4)
    paths = trace(rs, Packet("198.51.100.1", "10.96.0.1", 80, "tcp", "outside"))
    assert [(p.outcome, p.probability, p.count) for p in paths] == [(Outcome("dnat", "10.0.0.1:80"), 1, 2**40)]
    assert interpret(rs, Packet("198.51.100.1", "10.96.0.1", 80, "tcp", "outside")) == {Outcome("dnat", "10.0.0.1:80"): 1}
    assert len(check(rs).services) == 40


@pytest.mark.parametrize("exponent", [32, 64])
def test_numgen_with_a_huge_modulus(exponent: int) -> None:
    """Two map slots of 2^32 (or 2^64): their shares in closed form, the rest falls through."""
    mod = 2**exponent
    doc = {"nftables": [
        {"table": {"family": "ip", "name": "t"}},
        {"map": {"family": "ip", "table": "t", "name": "eps", "type": "integer", "map": "ipv4_addr",
                 "elem": [[0, "10.0.0.1"], [1, "10.0.0.2"], [mod - 1, "10.0.0.3"]]}},
        {"chain": {"family": "ip", "table": "t", "name": "svc"}},
        {"rule": {"family": "ip", "table": "t", "chain": "svc", "expr": [{"dnat": {"family": "ip", "addr": {"map": {
            "key": {"numgen": {"mode": "random", "mod": mod, "offset": 0}}, "data": "@eps"}}}}]}},
    ]}
    rs = nft_json.parse(doc)
    report = check(rs)
    (svc,) = report.services
    share = Fraction(1, 2**32)  # 2^32: each slot holds one random value; 2^64: slot 0 holds r = 0 only
    got = dict(svc.endpoints)  # the probe's port (1) is kept: the map holds addresses only
    if exponent == 32:
        assert got == {"10.0.0.1:1": share, "10.0.0.2:1": share, "10.0.0.3:1": share}
        assert svc.fallthrough == 1 - 3 * share
    else:  # slots 1 and 2^64-1 hold no 32-bit random value at all
        assert got == {"10.0.0.1:1": share} and svc.fallthrough == 1 - share
    assert any(p.kind == "numgen-slots" and "more find no slot" in p.detail for p in report.problems)


def _linear(elements: list[Element], value: object) -> Element | None:
    parts = value if isinstance(value, tuple) else (value,)
    for el in elements:
        if len(el.key) == len(parts) and all(key_matches(v, k) for v, k in zip(parts, el.key)):
            return el
    return None


def test_element_index_answers_as_a_scan() -> None:
    rng = random.Random(7)
    addr = lambda: ipaddress.ip_address(f"10.0.{rng.randrange(4)}.{rng.randrange(8)}")  # noqa: E731

    def component(kind: int) -> Const | Prefix | Range:
        if kind == 0:
            return Const(addr())
        if kind == 1:
            return Prefix(ipaddress.ip_network(f"10.0.{rng.randrange(4)}.0/{rng.choice([16, 24, 30])}", strict=False))
        if kind == 2:
            lo = rng.randrange(100)
            return Range(lo, lo + rng.randrange(10))
        return Const(rng.choice(["tcp", "udp"]))

    for _ in range(200):
        shapes = rng.choice([(0,), (1,), (2,), (0, 3), (1, 3), (0, 2), (1, 2)])
        elements = [Element(tuple(component(k) for k in shapes), Const(i)) for i in range(rng.randrange(1, 30))]
        index = ElementIndex(elements)
        for _ in range(30):
            value = tuple(addr() if k in (0, 1) else rng.randrange(110) if k == 2 else rng.choice(["tcp", "udp"]) for k in shapes)
            probe = value[0] if len(value) == 1 else value
            assert index.find(probe) is _linear(elements, probe), (elements, probe)


def test_trace_from_file_imports_nothing_it_does_not_use(imports_of, capsys) -> None:  # noqa: ANN001
    """K.6: a small `trace --from-file` is a fast start: not the API client, nor netlink, nor the
    daemon's HTTP servers and metrics, nor the YAML loader."""
    heavy = ("kubernetes", "pyroute2", "aiohttp", "prometheus_client", "yaml", "nftables")
    with imports_of(*heavy) as seen:
        from nfproxy.cli.main import main

        status = main(["trace", "--from-file", str(DUMPS / "kube-proxy-nft.json"), "10.0.1.1", "172.30.0.41:80/tcp"])
    assert status == 0, capsys.readouterr().err
    assert seen == set()