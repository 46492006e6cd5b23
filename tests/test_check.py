"""`check` on live rules: a clean node is clean, and each injected defect is found.

Each kernel test applies a rendering of examples/ in a throwaway namespace, breaks one thing with the
real `iptables` / `nft` tools inside that namespace, reads the rules back as `check` does
(dump.read_live) and asserts the defect's kind. Upstream kube-proxy dumps are checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nfproxy.analysis import dump
from nfproxy.analysis.check import check
from nfproxy.cli.main import main
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import run
from nfproxy.core.model import NodeConfig
from nfproxy.sources import manifests
from nfproxy.verify.validate import apply_iptables, apply_nft

ROOT = Path(__file__).resolve().parent.parent
DUMPS = Path(__file__).resolve().parent / "dumps"
STATE = manifests.load(str(ROOT / "examples"), NodeConfig()).state
CATALOG_SVC = "KUBE-SVC-ITBI3OHKD3FRXPDK"  # shop/catalog:http, 3 endpoints, cascade rules 2-4
CATALOG_SEPS = ("KUBE-SEP-4COZ3TLFZVOEO2RW", "KUBE-SEP-CPIHQ53BNMXPXITL", "KUBE-SEP-VVC56VKD2FNUHTBR")


def kinds(ns: str, backend: str) -> set[str]:
    report = check(dump.read_live(backend, ns).ruleset, node_ips=["192.168.0.2"])
    return {p.kind for p in report.problems}


@pytest.fixture
def ipt(netns: str) -> str:
    apply_iptables(STATE, netns)
    return netns


@pytest.fixture
def nft(netns: str) -> str:
    apply_nft(STATE, netns)
    return netns


def iptables(ns: str, *args: str) -> None:
    run(["iptables", *args], netns=ns)


def nft_rule_handle(ns: str, chain_prefix: str, needle: str) -> tuple[str, int]:
    doc = NftSession(ns).list_table("ip", "nfproxy")
    for item in doc["nftables"]:
        rule = item.get("rule")
        if rule and rule["chain"].startswith(chain_prefix) and needle in json.dumps(rule["expr"]):
            return rule["chain"], rule["handle"]
    raise AssertionError(f"no rule with {needle} in {chain_prefix}*")


# ---- clean


@pytest.mark.kernel
def test_clean_iptables(ipt: str) -> None:
    report = check(dump.read_live("iptables", ipt).ruleset)
    assert report.clean, report.problems
    assert len(report.services) == 10
    catalog = next(s for s in report.services if s.chain == CATALOG_SVC)
    assert len(catalog.endpoints) == 3 and 0 < catalog.worst_deviation_ppb < 1
    cart = next(s for s in report.services if s.name == "shop/cart:http")
    assert cart.affinity_timeout == 600


@pytest.mark.kernel
def test_clean_nft(nft: str) -> None:
    report = check(dump.read_live("nft", nft).ruleset)
    assert report.clean, report.problems
    catalog = next(s for s in report.services if s.name == "shop/catalog:http" and s.chain.startswith("service-"))
    assert [str(p) for _, p in catalog.endpoints] == ["715827883/2147483648", "1431655765/4294967296", "1431655765/4294967296"]


@pytest.mark.kernel
def test_cli_exit_status(ipt: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--backend", "iptables", "--netns", ipt, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clean"] and out["services"]
    iptables(ipt, "-t", "nat", "-R", CATALOG_SVC, "2", "-m", "statistic", "--mode", "random", "--probability", "0.25", "-j", CATALOG_SEPS[0])
    assert main(["check", "--backend", "iptables", "--netns", ipt]) == 1
    assert "cascade-probability" in capsys.readouterr().out


# ---- iptables defects


@pytest.mark.kernel
def test_iptables_cascade_probability(ipt: str) -> None:
    iptables(ipt, "-t", "nat", "-R", CATALOG_SVC, "3", "-m", "statistic", "--mode", "random", "--probability", "0.3", "-j", CATALOG_SEPS[1])
    assert "cascade-probability" in kinds(ipt, "iptables")


@pytest.mark.kernel
def test_iptables_last_rule_probability(ipt: str) -> None:
    iptables(ipt, "-t", "nat", "-R", CATALOG_SVC, "4", "-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", CATALOG_SEPS[2])
    assert "last-rule-probability" in kinds(ipt, "iptables")


@pytest.mark.kernel
def test_iptables_unreachable_endpoint(ipt: str) -> None:
    # An unconditional jump first: the cascade after it is dead.
    iptables(ipt, "-t", "nat", "-I", CATALOG_SVC, "2", "-j", CATALOG_SEPS[0])
    assert "unreachable-endpoint" in kinds(ipt, "iptables")


@pytest.mark.kernel
def test_iptables_orphaned_endpoint_chain(ipt: str) -> None:
    iptables(ipt, "-t", "nat", "-D", CATALOG_SVC, "3")
    found = kinds(ipt, "iptables")
    assert "unreachable-endpoint" in found and "cascade-probability" in found


@pytest.mark.kernel
def test_iptables_ungated_filter_jump(ipt: str) -> None:
    iptables(ipt, "-t", "filter", "-I", "OUTPUT", "1", "-j", "KUBE-SERVICES")
    assert "ungated-filter-jump" in kinds(ipt, "iptables")


def test_iptables_missing_chain_in_a_dump() -> None:
    # The kernel refuses a jump to a missing chain, so this defect only exists in text (a
    # restore payload about to be applied, a doctored dump).
    text = (DUMPS / "kube-proxy-iptables-save.txt").read_text().replace(
        ":KUBE-SEP-C6EBXVWJJZMIWKLZ - [0:0]\n", ""
    ).replace("-A KUBE-SEP-C6EBXVWJJZMIWKLZ", "-A KUBE-SEP-GONE")
    report = check(dump.read_text(text).ruleset)
    assert "missing-chain" in {p.kind for p in report.problems}


# ---- nft defects


@pytest.mark.kernel
def test_nft_numgen_slot_missing(nft: str) -> None:
    chain, _ = nft_rule_handle(nft, "service-N3ITGKYC-shop/catalog", "numgen")
    doc = NftSession(nft).list_table("ip", "nfproxy")
    rule = next(i["rule"] for i in doc["nftables"] if "rule" in i and i["rule"]["chain"] == chain and "numgen" in json.dumps(i["rule"]))
    text = json.dumps(rule["expr"])
    if "@endpoints-" in text:  # shared map: delete the key (or range) of this chain's middle endpoint
        ng = json.loads(text)[-1]["dnat"]["addr"]["map"]["key"]["numgen"]
        middle = ng["offset"] % (1 << 32) + ng["mod"] // 2
        shard = json.loads(text)[-1]["dnat"]["addr"]["map"]["data"].lstrip("@")
        listed = next(i["map"] for i in doc["nftables"] if "map" in i and i["map"]["name"] == shard)
        keys = [key["elem"]["val"] for key, _ in listed["elem"]]
        if "-hash-" in shard:  # one key per endpoint
            assert middle in keys
            element = str(middle)
        else:
            low, high = next(r for r in (k["range"] for k in keys if isinstance(k, dict)) if r[0] <= middle <= r[1])
            element = f"{low}-{high}"
        run(["nft", "delete", "element", "ip", "nfproxy", shard, f"{{ {element} }}"], netns=nft)
    else:  # anonymous vmap: change the modulus
        _, handle = nft_rule_handle(nft, chain, "numgen")
        run(["nft", "replace", "rule", "ip", "nfproxy", chain, "handle", str(handle), "numgen random mod 4 vmap { 0 : accept }"], netns=nft)
    assert "numgen-slots" in kinds(nft, "nft")


@pytest.mark.kernel
def test_nft_numgen_modulus_too_small(nft: str) -> None:
    chain, handle = nft_rule_handle(nft, "service-N3ITGKYC-shop/catalog", "numgen")
    doc = NftSession(nft).list_table("ip", "nfproxy")
    rule = next(i["rule"] for i in doc["nftables"] if "rule" in i and i["rule"]["handle"] == handle)
    expr = rule["expr"]
    # Same rule, a modulus a third too small (three endpoints: `mod 3` into a hash map, or
    # `mod LANE` over ranges of a third each): the third endpoint can never be drawn.
    said = json.dumps(expr)
    smaller = said.replace('"mod": 3,', '"mod": 2,') if '"mod": 3,' in said else said.replace('"mod": 223423200', '"mod": 148948800')
    assert smaller != said
    text = json.dumps({"nftables": [{"replace": {"rule": {"family": "ip", "table": "nfproxy", "chain": chain, "handle": handle, "expr": json.loads(smaller)}}}]})
    run(["nft", "-j", "-f", "-"], netns=nft, stdin=text)
    report = check(dump.read_live("nft", nft).ruleset)
    catalog = next(s for s in report.services if s.chain == chain)
    assert len(catalog.endpoints) == 2  # the third endpoint is gone from the distribution
    assert {p.kind for p in report.problems} & {"numgen-slots", "unreachable-endpoint"}


@pytest.mark.kernel
def test_nft_unreachable_endpoint(nft: str) -> None:
    # shop/cart keeps per-endpoint chains (affinity); make its random choice pick only one.
    chain, handle = nft_rule_handle(nft, "service-242WI43H-shop/cart", "numgen")
    target = next(c for c in NftSession(nft).list_table("ip", "nfproxy")["nftables"] if "chain" in c and c["chain"]["name"].startswith("endpoint-RRDCVT4G"))["chain"]["name"]
    run(["nft", "replace", "rule", "ip", "nfproxy", chain, "handle", str(handle), f"numgen random mod 2 vmap {{ 0 : goto {target} , 1 : goto {target} }}"], netns=nft)
    assert "unreachable-endpoint" in kinds(nft, "nft")


@pytest.mark.kernel
def test_nft_ungated_filter_jump(nft: str) -> None:
    chain, handle = nft_rule_handle(nft, "filter-output", "service-endpoints-check")
    run(["nft", "replace", "rule", "ip", "nfproxy", chain, "handle", str(handle), "jump service-endpoints-check"], netns=nft)
    assert "ungated-filter-jump" in kinds(nft, "nft")


@pytest.mark.kernel
def test_the_kernel_takes_15_levels_of_jumps_and_check_agrees(netns: str) -> None:
    """analysis.check.JUMP_STACK is the running kernel's: a base chain with gotos 15 deep is
    taken and `check` finds nothing; one level more is refused ("Too many links"), which is
    what `jump-depth` reports of a dump."""
    from nfproxy.analysis.check import JUMP_STACK
    from nfproxy.kernel.process import KernelError

    def table(levels: int) -> str:
        lines = ["add table ip deep", "delete table ip deep", "add table ip deep",
                 "add chain ip deep out { type filter hook output priority 0 ; }"]
        lines += [f"add chain ip deep c{i}" for i in range(1, levels + 1)]
        lines += ["add rule ip deep out goto c1"] + [f"add rule ip deep c{i} jump c{i + 1}" for i in range(1, levels)]
        return "\n".join(lines) + "\n"

    session = NftSession(netns)
    session.apply(table(JUMP_STACK - 1))
    ruleset = dump.read_live("nft", netns).ruleset
    deep = ruleset.table("ip", "deep")
    assert deep is not None and len(deep.chains) == JUMP_STACK  # the base chain and 15 below it
    assert not [p for p in check(ruleset).problems if p.kind == "jump-depth"]
    with pytest.raises(KernelError, match="Too many links"):
        session.apply(table(JUMP_STACK))


def test_nft_missing_chain_in_a_dump() -> None:
    doc = json.loads((DUMPS / "kube-proxy-nft.json").read_text())
    doc["nftables"] = [i for i in doc["nftables"] if not ("chain" in i and i["chain"]["name"].startswith("endpoint-ZCZBVNAZ"))
                       and not ("rule" in i and i["rule"]["chain"].startswith("endpoint-ZCZBVNAZ"))]
    report = check(dump.read_text(json.dumps(doc)).ruleset)
    assert "missing-chain" in {p.kind for p in report.problems}


# ---- upstream kube-proxy dumps


@pytest.mark.parametrize("name", ["kube-proxy-iptables-save.txt", "kube-proxy-iptables-restore.txt", "kube-proxy-nft.json"])
def test_upstream_dumps_are_clean(name: str) -> None:
    source = dump.read_file(str(DUMPS / name))
    report = check(source.ruleset)
    assert report.clean, report.problems
    (svc,) = report.services
    assert svc.name == "ns1/svc1:p80"
    n = len(svc.endpoints)
    assert sum(p for _, p in svc.endpoints) == 1
    assert svc.worst_deviation_ppb < 1 and (n != 3 or svc.worst_deviation_ppb > 0)
    if "restore" in name:
        assert svc.affinity_timeout == 10800
