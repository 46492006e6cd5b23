"""nft rules read back as JSON, shown as nft syntax: what nft itself prints for the same rule.

The strong check runs the real nft: every rule of the example cluster (ClientIP affinity, Local
traffic policy, source ranges, weights, no-endpoint services, both families), applied in a
throwaway namespace, as `nft -j` and as `nft -a list` print it, rule by rule (by handle).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nfproxy.analysis.nft_rule_text import readable
from nfproxy.kernel import netns
from nfproxy.kernel.process import run

ROOT = Path(__file__).resolve().parent.parent


def _normal(text: str) -> str:
    """What may differ without changing the meaning: number spelling (0x00004000, 16384),
    counter values, the comment, the default reject's spelled-out type."""
    text = re.sub(r" comment \"[^\"]*\"$", "", text.strip())
    text = re.sub(r"counter packets \d+ bytes \d+", "counter", text)
    text = re.sub(r"0x[0-9a-f]+", lambda m: str(int(m.group(0), 16)), text)
    text = re.sub(r" with icmp(v6)? port-unreachable", "", text)
    return " ".join(text.split())


@pytest.mark.kernel
@pytest.mark.parametrize("manifests", ["examples", "examples-weighted"])
def test_every_rule_reads_as_nft_prints_it(manifests: str) -> None:
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.sources.manifests import load

    state = load(ROOT / manifests).state
    with netns.throwaway("nfp-text") as ns, Proxier("nft", netns=ns) as proxier:
        proxier.sync(state)
        doc = json.loads(run(["nft", "-j", "list", "ruleset"], netns=ns))
        listing = run(["nft", "-a", "list", "ruleset"], netns=ns)
    printed: dict[tuple[str, str, int], str] = {}  # handles count per table
    family = table = ""
    for line in listing.splitlines():
        head = re.match(r"table (\S+) (\S+) ", line)
        if head:
            family, table = head.group(1), head.group(2)
        found = re.match(r"\s*(.*\S) # handle (\d+)$", line)
        if found and not line.lstrip().startswith(("chain ", "set ", "map ", "table ", "counter ")):
            printed[(family, table, int(found.group(2)))] = found.group(1)
    rules = [item["rule"] for item in doc["nftables"] if "rule" in item]
    assert len(rules) > 40
    if manifests == "examples-weighted":  # shop/search (1:2:14) lives in the off table
        assert any(rule["table"] == "nfproxy-off" for rule in rules)
    for rule in rules:
        nft_says = printed[(rule["family"], rule["table"], rule["handle"])]
        assert _normal(readable(json.dumps(rule["expr"]))) == _normal(nft_says), rule


@pytest.mark.parametrize("text", [
    "-A KUBE-SERVICES -j KUBE-NODEPORTS",  # iptables text stays as read
    "[1,",  # not JSON
    '{"match": 1}',  # JSON, not a list of expressions
    "[" * 100_000,  # nested too deep for the JSON reader
    "",
])
def test_what_is_not_an_nft_rule_is_shown_as_it_is(text: str) -> None:
    assert readable(text) == text


def test_what_is_not_spelled_out_is_shown_as_json() -> None:
    rule = [{"match": {"op": "==", "left": {"osf": {"key": "name"}}, "right": "Linux"}}, {"log": {"prefix": "x"}}]
    assert readable(json.dumps(rule)) == '{"osf":{"key":"name"}} Linux {"log":{"prefix":"x"}}'


def test_a_bitwise_match_keeps_its_operator() -> None:
    rule = [{"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 16384]}, "right": 0}}, {"return": None}]
    assert readable(json.dumps(rule)) == "meta mark & 0x4000 == 0x0 return"
