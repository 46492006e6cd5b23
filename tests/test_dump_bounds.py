"""Issue R, items 1 and 2: a dump is read as the kernel's own tools read it.

Item 1: every number in a dump is bounded as `nft -j` (jansson: 64-bit integers, finite reals)
and iptables-restore (16-bit ports, 32-bit marks) bound it, so no input ends in a traceback
(an integer of 5 000 digits used to end in Python's int-string-limit ValueError).
Item 2: what those tools refuse is an error naming the file and the place, never a clean
report: an address of the other family, NaN and infinities, a negative timeout, a value of the
wrong JSON type, a chain or table declared twice. Each case starts from a dump that reads clean
(exit 0), so what is refused is the one change made to it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nfproxy.analysis import dump
from nfproxy.cli.main import main

DUMPS = Path(__file__).resolve().parent / "dumps"
SAVE = (DUMPS / "kube-proxy-iptables-save.txt").read_text()
TRACE = ["10.0.9.9", "10.96.0.1:80/tcp"]

BASE: dict[str, Any] = {"nftables": [
    {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}},
    {"table": {"family": "ip", "name": "t", "handle": 1}},
    {"set": {"family": "ip", "name": "aff", "table": "t", "type": "ipv4_addr", "handle": 2,
             "flags": ["dynamic", "timeout"], "timeout": 10800}},
    {"map": {"family": "ip", "name": "eps", "table": "t", "type": "integer", "handle": 3,
             "map": ["ipv4_addr", "inet_service"],
             "elem": [[0, {"concat": ["10.0.0.1", 80]}], [1, {"concat": ["10.0.0.2", 80]}]]}},
    {"chain": {"family": "ip", "table": "t", "name": "pre", "handle": 4, "type": "nat", "hook": "prerouting",
               "prio": -100, "policy": "accept"}},
    {"chain": {"family": "ip", "table": "t", "name": "svc", "handle": 5}},
    {"rule": {"family": "ip", "table": "t", "chain": "pre", "handle": 6, "expr": [
        {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": "10.96.0.1"}},
        {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": 80}},
        {"jump": {"target": "svc"}}]}},
    {"rule": {"family": "ip", "table": "t", "chain": "svc", "handle": 7, "comment": "ns/svc:http", "expr": [
        {"dnat": {"family": "ip", "addr": {"map": {
            "key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}}, "data": "@eps"}}}}]}},
]}
TABLE, SET, MAP, PRE, SVC, RULE_PRE, RULE_SVC = range(1, 8)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def body(doc: dict[str, Any], index: int) -> dict[str, Any]:
    return next(iter(doc["nftables"][index].values()))  # type: ignore[no-any-return]


def edited(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    change(doc)
    return doc


def text_of(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1)


def line_of(text: str, needle: str) -> int:
    return text.count("\n", 0, text.index(needle)) + 1


def refused(capsys: pytest.CaptureFixture[str], path: Path, text: str, where: str, message: str,
            command: str = "check") -> None:
    """`text` is an error (exit 2) starting `FILE<where>: ` and saying `message`, one line, no report."""
    path.write_text(text)
    extra = TRACE if command == "trace" else []
    code, out, err = run(capsys, command, "--from-file", str(path), *extra)
    assert code == 2 and not out, (code, out, err)
    assert err.startswith(f"nfproxy: error: {path}{where}: "), err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_the_base_documents_read_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "base.json"
    path.write_text(text_of(BASE))
    code, out, err = run(capsys, "check", "--from-file", str(path))
    assert code == 0 and "no problems found" in out and "10.0.0.2:80" in out, (out, err)
    code, out, err = run(capsys, "trace", "--from-file", str(path), *TRACE)
    assert code == 0 and "DNAT 10.0.0.1:80  p = 1/2" in out, err
    code, out, err = run(capsys, "check", "--from-file", str(DUMPS / "kube-proxy-iptables-save.txt"))
    assert code == 0 and "no problems found" in out, err


# ---- item 1: numbers past what the tools read


HUGE = "9" * 5000


@pytest.mark.parametrize("command", ["check", "trace"])
@pytest.mark.parametrize("literal", [HUGE, "-" + HUGE, str(2**63), str(-(2**63) - 1)])
def test_an_integer_past_64_bits_is_an_error_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], literal: str, command: str
) -> None:
    """nft reads JSON with jansson, whose integers are 64-bit ("too big integer"); 5 000 digits
    ended in Python's int-string-limit ValueError, a traceback."""
    text = text_of(BASE).replace('"handle": 1\n', f'"handle": {literal}\n', 1)
    message = "digits" if len(literal) > 100 else "64-bit"
    refused(capsys, tmp_path / "dump.json", text, f":{line_of(text, literal)}", message, command)


def test_a_huge_integer_anywhere_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In an element, a rule, a key nothing reads, a string's neighbour: the line is the number's."""
    base = text_of(BASE)
    for old in ('"mod": 2', '"offset": 0', '"right": 80', '"json_schema_version": 1'):
        key = old.split(":")[0]
        text = base.replace(old, f"{key}: {HUGE}", 1)
        refused(capsys, tmp_path / "dump.json", text, f":{line_of(text, HUGE)}", "5000 digits")
    text = base.replace("[\n      0,", f"[\n      {HUGE},", 1)
    assert HUGE in text
    refused(capsys, tmp_path / "dump.json", text, f":{line_of(text, HUGE)}", "5000 digits")


def test_read_text_raises_only_dump_errors() -> None:
    """The library entry point too: a DumpError naming the input, whatever the number."""
    for literal in (HUGE, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" + "0" * 400 + ".5",
                    "0." + "0" * 5000 + "1", "1e-99999", "1" + "0" * 4299):
        text = text_of(BASE).replace('"handle": 1\n', f'"handle": {literal}\n', 1)
        try:
            dump.read_text(text, "dump.json")
        except dump.DumpError as exc:
            assert str(exc).startswith("dump.json:"), exc
        else:
            raise AssertionError(f"{literal[:40]} was read")


IPT_BIG = [  # (old, new, message): numbers iptables-restore reads into 16 or 32 bits
    ("-m tcp -j DNAT --to-destination 10.180.0.3:80", "-m tcp --dport " + HUGE + " -j DNAT --to-destination 10.180.0.3:80", "port"),
    ("-m tcp -j DNAT --to-destination 10.180.0.3:80", "-m tcp --dport 65536 -j DNAT --to-destination 10.180.0.3:80", "port"),
    ("-m tcp -j DNAT --to-destination 10.180.0.3:80", "-m tcp --dport 1:" + HUGE + " -j DNAT --to-destination 10.180.0.3:80", "port"),
    ("-j MARK --set-xmark 0x4000/0x0", "-j MARK --set-xmark 0x" + "f" * 5000 + "/0x0", "mark"),
    ("-j MARK --set-xmark 0x4000/0x0", "-j MARK --set-xmark 0x100000000/0x0", "mark"),
    ("--mark 0x4000/0x4000", "--mark 0x4000/" + HUGE, "mark"),
]


@pytest.mark.parametrize("case", range(len(IPT_BIG)))
def test_an_iptables_number_past_its_bits_is_an_error_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int
) -> None:
    """iptables-restore: "invalid port/service", "Bad MARK value"; the reader took 70 000 as a
    port and 2^32 as a mark, and 5 000 digits as Python's int-string limit message."""
    old, new, message = IPT_BIG[case]
    assert old in SAVE
    text = SAVE.replace(old, new, 1)
    where = f":{line_of(text, new)}"
    refused(capsys, tmp_path / "save.txt", text, where, message)
    path = tmp_path / "save.txt"
    _, _, err = run(capsys, "check", "--from-file", str(path))
    assert "set_int_max_str_digits" not in err


# ---- item 2: what the tools refuse


def test_an_ipv6_dnat_in_an_ipv4_save_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was read as an endpoint [fd00::1]:80 with a share of 1/3, and "no problems found"."""
    for old, new in (("--to-destination 10.180.0.3:80", "--to-destination [fd00::1]:80"),
                     ("-s 10.180.0.3/32", "-s fd00::1/128"),
                     ("-d 127.0.0.0/8", "-d ::1/128")):
        text = SAVE.replace(old, new, 1)
        refused(capsys, tmp_path / "save.txt", text, f":{line_of(text, new)}", "IPv6")


def test_an_ipv4_address_in_an_ipv6_save_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = ("# Generated by ip6tables-save v1.8.9 (nf_tables)\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-A - [0:0]\n"
            "-A PREROUTING -d fd00::10/128 -j KUBE-SVC-A\n"
            "-A KUBE-SVC-A -p tcp -m tcp -j DNAT --to-destination 10.1.0.1:80\nCOMMIT\n")
    refused(capsys, tmp_path / "save.txt", text, ":6", "IPv4")


NFT_FAMILY = [  # an IPv6 address where the table's or the type's family is IPv4
    lambda d: body(d, MAP)["elem"][1].__setitem__(1, {"concat": ["fd00::1", 80]}),
    lambda d: body(d, RULE_PRE)["expr"][0]["match"].__setitem__("right", "fd00::1"),
    lambda d: body(d, RULE_SVC)["expr"].__setitem__(0, {"dnat": {"family": "ip", "addr": "fd00::1", "port": 80}}),
    lambda d: body(d, SET).__setitem__("elem", ["10.0.0.9", "fd00::9"]),
]


@pytest.mark.parametrize("case", range(len(NFT_FAMILY)))
def test_an_address_of_the_other_family_in_nft_json_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int
) -> None:
    refused(capsys, tmp_path / "dump.json", text_of(edited(NFT_FAMILY[case])), "", "IPv6")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("key", ['"handle": 1\n', '"timeout": 10800', '"mod": 2'])
def test_nan_and_infinities_are_an_error_with_their_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], literal: str, key: str
) -> None:
    """Not JSON (NaN, Infinity) or past a double (1e999): jansson, and so nft, refuse them."""
    name = key.split(":")[0]
    text = text_of(BASE).replace(key, f"{name}: {literal}" + key[len(key.rstrip()):], 1)
    refused(capsys, tmp_path / "dump.json", text, f":{line_of(text, literal)}", literal.lstrip("-"))


@pytest.mark.parametrize("timeout", [-1, -10800, 2**62])
def test_a_set_timeout_the_kernel_refuses_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], timeout: int
) -> None:
    """A negative timeout is no kernel's; one past 2^64 ns neither (nf_msecs_to_jiffies64: ERANGE)."""
    doc = edited(lambda d: body(d, SET).__setitem__("timeout", timeout))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", "(set 'aff'): timeout")


WRONG_TYPES = [  # (change, what the message names)
    (lambda d: body(d, TABLE).__setitem__("handle", "1"), "(table 't'): handle"),
    (lambda d: body(d, TABLE).__setitem__("handle", [1]), "(table 't'): handle"),
    (lambda d: body(d, SVC).__setitem__("handle", {"id": 5}), "(chain 'svc'): handle"),
    (lambda d: body(d, RULE_SVC).__setitem__("comment", 5), "(rule 'svc'): comment"),
    (lambda d: body(d, SET).__setitem__("flags", [1]), "(set 'aff'): flags"),
    (lambda d: body(d, SET).__setitem__("timeout", "10800"), "(set 'aff'): timeout"),
    (lambda d: body(d, SET).__setitem__("timeout", 10800.5), "(set 'aff'): timeout"),
    (lambda d: body(d, SET).__setitem__("type", 7), "(set 'aff'): type"),
    (lambda d: body(d, MAP).__setitem__("map", 7), "(map 'eps'): map"),
    (lambda d: body(d, MAP).__setitem__("size", [65536]), "(map 'eps'): size"),
    (lambda d: body(d, PRE).__setitem__("prio", -100.0), "(chain 'pre'): prio"),
    (lambda d: body(d, RULE_PRE).__setitem__("expr", body(d, RULE_PRE)["expr"] + [{"counter": {"packets": [0], "bytes": 0}}]),
     "(rule 'pre'): counter packets"),
    (lambda d: body(d, RULE_SVC)["expr"][0]["dnat"]["addr"]["map"]["key"]["numgen"].__setitem__("mod", [2]),
     "(rule 'svc'): numgen mod"),
    (lambda d: body(d, MAP)["elem"][0].__setitem__(1, {"concat": ["10.0.0.1", [80]]}), "(map 'eps')"),
]


@pytest.mark.parametrize("case", range(len(WRONG_TYPES)))
def test_a_value_of_the_wrong_json_type_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int) -> None:
    """`nft -j list` prints each key with one type; an integer where a string belongs, a list
    where a number belongs, was read (or skipped) and the dump reported clean."""
    change, message = WRONG_TYPES[case]
    refused(capsys, tmp_path / "dump.json", text_of(edited(change)), "", message)


def test_a_chain_declared_twice_in_nft_json_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`nft -j list` lists each chain once; the reader kept the last declaration."""
    again = {"chain": {**body(BASE, SVC), "handle": 9}}
    doc = edited(lambda d: d["nftables"].insert(SVC + 1, again))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", f"nftables[{SVC + 1}] (chain 'svc'): declared again")
    hooked = {"chain": {**body(BASE, PRE), "prio": 100}}  # a contradiction, too
    doc = edited(lambda d: d["nftables"].append(hooked))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", f"(first at nftables[{PRE}])")


def test_a_table_or_set_declared_twice_in_nft_json_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = edited(lambda d: d["nftables"].append(copy.deepcopy(BASE["nftables"][TABLE])))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", "(table 't'): declared again")
    doc = edited(lambda d: d["nftables"].extend(copy.deepcopy(BASE["nftables"][TABLE:])))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", "(table 't'): declared again")
    doc = edited(lambda d: d["nftables"].append(copy.deepcopy(BASE["nftables"][MAP])))
    refused(capsys, tmp_path / "dump.json", text_of(doc), "", "(map 'eps'): declared again")


def test_a_chain_declared_twice_in_a_save_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """iptables-restore: "error creating chain 'KUBE-SVC-…': File exists"."""
    decl = ":KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]"
    text = SAVE.replace(decl, decl + "\n" + decl, 1)
    refused(capsys, tmp_path / "save.txt", text, f":{line_of(text, decl) + 1}", "declared again")
    # A built-in chain's policy may be given again: restore sets it twice, as the reader does.
    text = SAVE.replace(":OUTPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]", 1)
    path = tmp_path / "save.txt"
    path.write_text(text)
    code, out, err = run(capsys, "check", "--from-file", str(path))
    assert code == 0 and "no problems found" in out, err


def test_a_table_twice_in_one_save_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nat = SAVE[SAVE.index("*nat"):SAVE.index("COMMIT", SAVE.index("*nat")) + len("COMMIT\n")]
    text = SAVE + nat
    refused(capsys, tmp_path / "save.txt", text, f":{text.count(chr(10), 0, text.rindex('*nat')) + 1}", "*nat again")


def test_an_unmarked_save_is_of_the_family_of_its_first_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a header, one IPv6 DNAT made the whole IPv4 save read as IPv6."""
    body = SAVE.replace("# Generated by iptables-save v1.8.9 (nf_tables) on Tue Mar  4 10:00:00 2025\n", "")
    assert "Generated" not in body
    new = "--to-destination [fd00::1]:80"
    text = body.replace("--to-destination 10.180.0.3:80", new, 1)
    refused(capsys, tmp_path / "save.txt", text, f":{line_of(text, new)}", "fd00::1 is an IPv6 address in an IPv4 save")


LONG = "x" * 300


@pytest.mark.parametrize("change, message", [
    (lambda d: body(d, SVC).__setitem__("name", LONG), "name of 300 bytes"),
    (lambda d: body(d, RULE_SVC).__setitem__("comment", LONG), "comment must be a string of at most 253 bytes"),
    (lambda d: body(d, MAP)["elem"][0].__setitem__(0, "9" * 5000), "no number the kernel holds"),
    (lambda d: body(d, RULE_PRE)["expr"][1]["match"].__setitem__("right", "9" * 5000), "no number the kernel holds"),
])
def test_a_string_past_the_kernels_bounds_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      change: Callable[[dict[str, Any]], object], message: str) -> None:
    """Names of at most 255 bytes (NFT_NAME_MAXLEN), comments that fit the rule's 256 bytes of
    user data, a number spelt as a string no longer than a number can be."""
    refused(capsys, tmp_path / "dump.json", text_of(edited(change)), "", message)


@pytest.mark.parametrize("old, new, message", [
    (":KUBE-MARK-MASQ - [0:0]", ":KUBE-MARK-MASQ-" + "X" * 20 + " - [0:0]", "too long (28 chars max)"),
    ('--comment "ns1/svc1:p80"', f'--comment "{LONG}"', "comment of 300 characters"),
    ("-p tcp -m comment", "-p " + HUGE + " -m comment", "no number the kernel holds"),
    ("-p tcp -m comment", "-p 256 -m comment", "protocol 256 out of range"),
])
def test_a_save_past_xtables_bounds_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               old: str, new: str, message: str) -> None:
    assert old in SAVE
    text = SAVE.replace(old, new, 1)
    refused(capsys, tmp_path / "save.txt", text, f":{line_of(text, new)}", message)


def test_a_table_iptables_does_not_have_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """iptables-restore: "can't initialize iptables table `nat2': Table does not exist"; the
    reader took *nat2 as a table of user chains and reported it clean."""
    text = SAVE.replace("*nat", "*nat2", 1)
    refused(capsys, tmp_path / "save.txt", text, f":{line_of(text, '*nat2')}", "*nat2: no such table")


def _anonymous_map(d: dict[str, Any]) -> None:
    dnat = body(d, RULE_SVC)["expr"][0]["dnat"]
    dnat["addr"]["map"]["data"] = {"set": [[0, "not-an-address"], [1, "10.0.0.2"]]}


@pytest.mark.parametrize("command", ["check", "trace"])
@pytest.mark.parametrize("change, message", [
    (lambda d: body(d, MAP).__setitem__("map", ["-1", "inet_service"]), "(rule 'svc'): dnat to map @eps, whose data"),
    (lambda d: body(d, MAP).update({"map": "inet_service", "elem": [[0, 80], [1, 81]]}),
     "(rule 'svc'): dnat to map @eps, whose data (int) is not an address"),
    (_anonymous_map, "(rule 'svc'): dnat to a map whose data"),
])
def test_a_dnat_through_a_map_of_no_addresses_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Callable[[dict[str, Any]], object], message: str,
    command: str,
) -> None:
    """nft refuses it (datatype mismatch); the walk took the map's data for an address and
    ended in an AttributeError traceback (found by fuzzing the base document's leaves)."""
    refused(capsys, tmp_path / "dump.json", text_of(edited(change)), "", message, command)


@pytest.mark.parametrize("command", ["check", "trace"])
@pytest.mark.parametrize("script, line", [
    ("add rule ip nfproxy c numgen random mod {huge} vmap {{ 0 : drop }}\n", 3),
    ("add rule ip nfproxy c tcp dport {huge} drop\n", 3),
])
def test_a_huge_number_in_an_nft_script_is_said_in_the_dumps_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], script: str, line: int, command: str
) -> None:
    """`nfproxy render --backend nft` text: the error named the line but in Python's words
    ("use sys.set_int_max_str_digits() to increase the limit")."""
    head = "add table ip nfproxy\nadd chain ip nfproxy c { type nat hook prerouting priority -100 ; }\n"
    refused(capsys, tmp_path / "rules.nft", head + script.format(huge=HUGE), f":{line}",
            "a number of 5000 digits: no field of the kernel's holds it", command)
