"""Endpoint-choice layouts for nfproxy's nft rules, against the real kube-proxy's, per new connection (issue S).

Every variant is nfproxy's own full render of the cluster (`kube_state`: S x 10 plus the API
server's `default/kubernetes`, as bench/first_connections.py --compare kube-proxy uses), with
only the endpoint choice rewritten in the text, loaded into the sandbox's node namespace by
`nft -f` in turns with the real kube-proxy's dump for the same cluster (bench/kube_rules.py).
The rest of the table (dispatch maps, checks, masquerade) is nfproxy's in every variant, so the
differences between variants are the endpoint choice alone, and each variant's ratio to
kube-proxy's rules is what the renderer would get by adopting it.

Variants (`--variants`, comma-separated; default all but `proxier`):

- `today`: the render as it is: `numgen random mod 223423200 offset k*M map
  @endpoints-counted-tcp-ranges-N`, an interval map (16 lanes per map) with a counter per element;
- `ranges`: the same interval maps without the counters;
- `hash-counted` / `hash`: unweighted chains draw `numgen random mod n offset k*M` into a plain
  (no interval flag) named map of the same grouping, keys k*M + i, value `ip . port`, with and
  without a counter per element: the kernel picks `rhash` (resizable hash) for a named map
  declared without a size;
- `hash-sized-counted` / `hash-sized`: the same with `size 256` in the declaration (16 lanes x 16
  endpoints), which makes the kernel pick its fixed `hash` set (`nft_hash_lookup_fast` for a 4-byte
  key), the backend of kube-proxy's anonymous maps;
- `anon`: kube-proxy's own form in nfproxy's chain: `numgen random mod n map { 0 : ip . port, ... }`,
  an anonymous constant map per chain, no counters (every endpoint change a rule change);
- `pipapo-counted`: the interval maps keyed by `numgen ... . meta l4proto` (a second field makes
  the kernel pick pipapo, AVX2 on this machine), with counters;
- `hash-sized-counted-fwd2`: `hash-sized-counted` with `forward-new`'s jump to
  `external-endpoints-check` left out, so that a forwarded first packet walks kube-proxy's two
  checks, not three: what the rest of the walk costs (a measurement, not a proposal: external
  IPs without endpoints would no longer be rejected in forward);
- `proxier`: the render as a full sync of nfproxy's Proxier writes it (what
  bench/first_connections.py measures), to show that `nft -f` of the text is the same kernel state.

Weighted chains (ranges of unequal widths) keep the interval form in every variant: this cluster
has none. Per variant and round: a fresh load (`nft flush ruleset`, `nft -f`), the CPUs idle,
300 sequential `connect()`s (p50), then `--kernel-connections` with perf as
bench/first_connections.py --kernel-cpu (samples of this process under nft_do_chain, x 50 us, per
connection, and their share of the busy samples), the order reversed every round
(`--resident`: a sandbox per variant, loaded every `--reload-every` rounds, the probes in turns
between loads). Prints the medians of the rounds and the ratios to kube-proxy's, and the
functions under the rules.

    sudo .venv/bin/python bench/nft_layout_variants.py --kube-proxy-dumps DUMPS --services 10000 --rounds 4
    sudo .venv/bin/python bench/nft_layout_variants.py --check     # each variant at 2 services: loads, lists, counters
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.backends import registry as backend_registry  # noqa: E402
from nfproxy.core.model import IPFamily  # noqa: E402
from nfproxy.kernel import netns as netns_mod  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

import first_connections as fc  # noqa: E402
from kube_rules import dump_name  # noqa: E402

MED = fc.MED
LANE = fc.render.LANE
SIZED = 256  # 16 lanes x up to 16 endpoints per lane

RULE = re.compile(r"^(?P<head>add rule ip nfproxy \S+ meta l4proto (?P<proto>\w+) dnat ip to )"
                  r"numgen random mod (?P<mod>\d+) offset (?P<off>\d+) map @(?P<map>endpoints-\S+-ranges-\d+)$")
MAPDECL = re.compile(r"^add map ip nfproxy (?P<map>endpoints-\S+-ranges-\d+) \{ (?P<body>.*) \}$")
ELEMS = re.compile(r"^add element ip nfproxy (?P<map>endpoints-\S+-ranges-\d+) \{$")
RANGE = re.compile(r"^\t(?P<lo>\d+)(?:-(?P<hi>\d+))? : (?P<val>[\d.]+ \. \d+),?$")

VARIANTS = ("today", "ranges", "hash-counted", "hash", "hash-sized-counted", "hash-sized", "anon", "pipapo-counted",
            "hash-sized-counted-fwd2", "proxier")
FORWARD_EXTERNAL = "add rule ip nfproxy forward-new jump external-endpoints-check"


def parse(text: str) -> tuple[list[str], dict[str, list[tuple[int, int, str]]]]:
    """The render's lines with the endpoint maps' element blocks taken out, and those elements
    per map: (lo, hi, 'ip . port')."""
    lines = text.splitlines()
    out: list[str] = []
    elems: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    i = 0
    while i < len(lines):
        m = ELEMS.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        i += 1
        while lines[i] != "}":
            r = RANGE.match(lines[i])
            assert r, lines[i]
            lo = int(r["lo"])
            elems[m["map"]].append((lo, int(r["hi"] or lo), r["val"]))
            i += 1
        i += 1
    return out, elems


def lane_of(elems: list[tuple[int, int, str]], off: int, mod: int) -> list[tuple[int, int, str]]:
    return [e for e in elems if off <= e[0] < off + mod]


def uniform(lane: list[tuple[int, int, str]], mod: int) -> bool:
    n = len(lane)
    return n > 0 and mod % n == 0 and all(hi - lo + 1 == mod // n for lo, hi, _ in lane)


def variant_text(text: str, variant: str) -> str:
    """nfproxy's render with the endpoint choice rewritten as `variant`."""
    if variant in ("today", "proxier"):
        return text
    if variant.endswith("-fwd2"):  # the forward path's checks as kube-proxy's: two, not three (measure only)
        assert FORWARD_EXTERNAL in text
        return variant_text(text.replace(FORWARD_EXTERNAL + "\n", ""), variant.removesuffix("-fwd2"))
    lines, elems = parse(text)
    out: list[str] = []
    new_elems: dict[str, list[str]] = collections.defaultdict(list)
    keep_ranges: set[str] = set()  # interval maps still used (weighted chains)
    new_maps: dict[str, str] = {}  # name -> declaration body
    for ln in lines:
        if MAPDECL.match(ln) or (ln.startswith("flush map ip nfproxy endpoints-") and "-ranges-" in ln):
            continue  # declared again below, as each variant needs
        r = RULE.match(ln)
        if not r:
            out.append(ln)
            continue
        mod, off, name, proto = int(r["mod"]), int(r["off"]), r["map"], r["proto"]
        lane = lane_of(elems[name], off, mod)
        typ = f"ip daddr . {proto} dport"
        if variant == "ranges" or (variant != "pipapo-counted" and not uniform(lane, mod)):
            keep_ranges.add(name)
            out.append(ln)
            continue
        n = len(lane)
        ordered = sorted(lane)
        if variant == "anon":
            body = ", ".join(f"{i} : {v}" for i, (_, _, v) in enumerate(ordered))
            out.append(f"{r['head']}numgen random mod {n} map {{ {body} }}")
        elif variant.startswith("hash"):
            hname = name.replace("-ranges-", "-hash-")
            flags = (" counter ;" if variant.endswith("counted") else "") + (f" size {SIZED} ;" if "sized" in variant else "")
            new_maps[hname] = f"typeof numgen random mod 1 : {typ} ;{flags}"
            out.append(f"{r['head']}numgen random mod {n} offset {off} map @{hname}")
            new_elems[hname] += [f"{off + i} : {v}" for i, (_, _, v) in enumerate(ordered)]
        elif variant == "pipapo-counted":
            pname = name.replace("-ranges-", "-pipapo-")
            new_maps[pname] = f"typeof numgen random mod 1 . meta l4proto : {typ} ; flags interval ; counter ;"
            out.append(f"{r['head']}numgen random mod {mod} offset {off} . meta l4proto map @{pname}")
            new_elems[pname] += [f"{lo}-{hi} . {proto} : {v}" for lo, hi, v in ordered]
        else:
            raise SystemExit(f"unknown variant {variant}")
    decls: list[str] = []
    for ln in lines:
        m = MAPDECL.match(ln)
        if m and (variant == "ranges" or m["map"] in keep_ranges):
            body = m["body"].replace(" counter ;", "") if variant == "ranges" else m["body"]
            decls += [f"add map ip nfproxy {m['map']} {{ {body} }}", f"flush map ip nfproxy {m['map']}"]
    for name, body in new_maps.items():
        decls += [f"add map ip nfproxy {name} {{ {body} }}", f"flush map ip nfproxy {name}"]
    # declarations right after the table's other sets (before the first rule), elements at the end
    at = next(i for i, ln in enumerate(out) if ln.startswith("add rule "))
    out[at:at] = decls
    for name in sorted(keep_ranges):
        if elems[name]:
            out.append(f"add element ip nfproxy {name} {{")
            out += [f"\t{lo}-{hi} : {v}," if hi != lo else f"\t{lo} : {v}," for lo, hi, v in elems[name]]
            out[-1] = out[-1].rstrip(",")
            out.append("}")
    for name, els in new_elems.items():
        out.append(f"add element ip nfproxy {name} {{")
        out += [f"\t{e}," for e in els]
        out[-1] = out[-1].rstrip(",")
        out.append("}")
    return "\n".join(out) + "\n"


def nft_install(path: Path) -> Callable[[Sandbox], None]:
    def install(sb: Sandbox) -> None:
        fc.clear(sb)
        fc._in_node(sb, "nft", "-f", str(path))
    return install


def check(services: int) -> int:
    """Each variant at a small size in a throwaway namespace: it loads, and the map lists back."""
    state = fc.kube_state(services)
    text = backend_registry.backend("nft").render(state, IPFamily.V4).text()
    with tempfile.TemporaryDirectory() as tmp, netns_mod.interruptible():
        ns = f"nfp-lv-{int(time.time()) % 100000}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            for v in VARIANTS:
                if v == "proxier":
                    continue
                p = Path(tmp) / f"{v}.nft"
                p.write_text(variant_text(text, v))
                subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], check=True)
                done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", str(p)], capture_output=True, text=True)
                print(f"== {v}: nft -f exit {done.returncode} {done.stderr.strip()[:2000]}")
                listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "ip", "nfproxy"],
                                        capture_output=True, text=True).stdout
                show = [ln for ln in listed.splitlines() if "numgen" in ln or "endpoints-" in ln or "counter packets" in ln]
                print("\n".join(show[:12]))
        finally:
            subprocess.run(["ip", "netns", "del", ns])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kube-proxy-dumps", type=Path)
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "proxier"))
    ap.add_argument("--no-kube-proxy", action="store_true", help="the variants only")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--kernel-connections", type=int, default=2000)
    ap.add_argument("--breakdown", type=int, default=16)
    ap.add_argument("--resident", action="store_true",
                    help="one sandbox per variant, each table loaded once per --reload-every rounds and probed in "
                         "turns without reloading (shorter turns, so more rounds in the same time)")
    ap.add_argument("--reload-every", type=int, default=3, help="--resident: rounds between fresh loads")
    ap.add_argument("--keep", type=Path, help="write each variant's script into this directory")
    ap.add_argument("--check", action="store_true", help="load each variant at --services (default 2 here) and list it")
    args = ap.parse_args()
    if args.check:
        return check(args.services if args.services != 10_000 else 2)
    if shutil.which("perf") is None:
        raise SystemExit("needs perf (Debian: apt install linux-perf)")
    state = fc.kube_state(args.services)
    served = sorted((sp for k, sp in state.services.items() if k in state.endpoints),
                    key=lambda sp: int(sp.name.name.split("-")[1]))
    target = fc.target_of(state, served[len(served) // 2].cluster_ip)
    text = backend_registry.backend("nft").render(state, IPFamily.V4).text()
    cases: dict[str, fc.Case] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        if not args.no_kube_proxy:
            if args.kube_proxy_dumps is None:
                raise SystemExit("--kube-proxy-dumps DIR (bench/kube_rules.py) or --no-kube-proxy")
            dump = args.kube_proxy_dumps / dump_name("nftables", args.services)
            if not dump.exists():
                raise SystemExit(f"{dump}: no such dump (bench/kube_rules.py writes it)")
            cases["kube-proxy nftables"] = fc.Case(fc.dump_install(dump), target)
        for v in args.variants.split(","):
            if v not in VARIANTS:
                raise SystemExit(f"unknown variant {v}: {', '.join(VARIANTS)}")
            if v == "proxier":
                cases[v] = fc.Case(fc.nfproxy_install(state, "nft"), target)
                continue
            p = where / f"nfproxy-{v}-{args.services}.nft"
            p.write_text(variant_text(text, v))
            cases[v] = fc.Case(nft_install(p), target)
        spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                              endpoints={ip: [(8080, "tcp")] for ip in target.endpoints})
        p50: dict[str, list[float]] = {n: [] for n in cases}
        cpu: dict[str, list] = {n: [] for n in cases}
        fargs = argparse.Namespace(connections=args.connections, kernel_cpu=True,
                                   kernel_connections=args.kernel_connections, breakdown=args.breakdown)
        print(f"# nft layout variants: {args.services} x 10, target {target.ip}:{target.port}, {args.rounds} rounds, "
              f"{args.connections} + {args.kernel_connections} connections, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
        with netns_mod.interruptible(), contextlib.ExitStack() as stack:
            if args.resident:
                boxes = {name: stack.enter_context(Sandbox(spec)) for name in cases}
            else:
                sb = stack.enter_context(Sandbox(spec))
            for r in range(args.rounds):
                order = list(cases) if r % 2 == 0 else list(reversed(cases))
                if args.resident:  # turns are short: rotate too, so no state keeps one slot of a round
                    order = order[r // 2 % len(order):] + order[: r // 2 % len(order)]
                if args.resident and r % args.reload_every == 0:
                    for name in order:  # every state's table made afresh, then all probed in turns
                        cases[name].install(boxes[name])
                    fc.settle(limit=30.0)
                for name in order:
                    if args.resident:
                        outcomes, got = resident_probe(boxes[name], cases[name], fargs)
                    else:
                        outcomes, got = fc.probe(sb, cases[name], fargs)
                    p50[name].append(MED(o.seconds for o in outcomes) * 1e6)
                    cpu[name].append(got)
                    print(f"round {r + 1} {name}: p50 {p50[name][-1]:.1f} µs, rules {got[0]:.2f} µs CPU per connection, "
                          f"{got[1]:.2%} of busy CPU  [{time.strftime('%H:%M:%S', time.gmtime())}]", flush=True)
                if r + 1 < args.rounds:
                    report(cases, p50, cpu, fargs, brief=True)  # so far: a run cut short still says something
        report(cases, p50, cpu, fargs)
    return 0


def resident_probe(sb: Sandbox, case: fc.Case, fargs: argparse.Namespace) -> tuple[list, tuple]:
    """fc.probe without the install: the state's table already sits in its own sandbox."""
    t = case.target
    sb.connect("pod", t.ip, t.port, "tcp", 10)  # warm up
    outcomes = sb.connect("pod", t.ip, t.port, "tcp", fargs.connections, parallel=1)
    assert all(o.ok for o in outcomes), outcomes[:3]
    return outcomes, fc.rules_cpu(sb, t.ip, t.port, fargs.kernel_connections)


def report(cases: dict, p50: dict, cpu: dict, fargs: argparse.Namespace, brief: bool = False) -> None:
    first = next(iter(cases))
    us = {n: [g[0] for g in cpu[n]] for n in cases}
    share = {n: [g[1] for g in cpu[n]] for n in cases}
    print()
    print(f"| variant | rules' CPU per connection (µs, median) | rounds | ratio to {first} | median of the rounds' "
          f"ratios | share of busy CPU, ratio | first connection p50 (µs) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n in cases:
        rr = [a / b for a, b in zip(us[n], us[first])]
        print(f"| {n} | {MED(us[n]):.2f} | {min(us[n]):.2f}–{max(us[n]):.2f} | {MED(us[n]) / MED(us[first]):.3f} | "
              f"{MED(rr):.3f} | {MED(share[n]) / MED(share[first]):.3f} | {MED(p50[n]):.1f} | "
              f"{MED(p50[n]) / MED(p50[first]):.3f} |")
    if not brief:
        fc.breakdown(cases, cpu, fargs)
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
