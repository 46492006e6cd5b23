"""First connections through the nft rules of one cluster in several states, taking turns.

One traffic sandbox, S x 10 services, one service probed (`connect()` + the server's line,
sequential, medians per round); before each probe a fresh proxier writes the state's rules (a
full sync, as a restart does) and the bench waits for the CPUs to go idle (the kernel frees the
replaced table in a worker, seconds of CPU), the states' order reversing every round so that the
machine's drift falls on all of them alike.

Until 2026-12-04 the sandbox's client kept its TIME_WAIT sockets, and from some 10 000
connections on, connect() walked the port range past them (perf: __inet_hash_connect), up to ms
per connection: that, not the rules, was the 1.14-1.44x the lanes comparison read in earlier
runs. The sandbox's namespaces now reuse those ports (tcp_tw_reuse, verify/sandbox.py).

- `--compare weights` (default): the cluster unweighted, with 1:2:7 cycled over each service's
  endpoints, and with nine of weight 1 and one of weight 2 (weighted rules, traffic nearly even);
- `--compare lanes`: the lane before 2026-12-03 (67 026 960, 64 per map) against today's, for the
  cluster unweighted and with 1:2:7 (LANE/LANES_PER_MAP set for this process only, `layout`);
- `--compare kube-proxy --kube-proxy-dumps DIR` (issue S): the real kube-proxy's rules for the
  same cluster (bench/kube_rules.py dumps them: `nft list table` in nftables mode,
  `iptables-legacy-save` in iptables mode) loaded by `nft -f` / `iptables-legacy-restore` in
  turns with nfproxy's own (a full sync; iptables with the legacy flavour, as kube-proxy's
  dump). The node's config is the cluster's: service CIDR 172.16.0.0/12 and the API server's
  `default/kubernetes` (172.16.0.1:443, no endpoints) in nfproxy's state too. In iptables mode
  KUBE-SERVICES is a linear list whose order differs (kube-proxy's follows Go map iteration),
  so each proxy is probed at the service whose jump is the middle one of its own KUBE-SERVICES
  (the same position, the mean cost of a walk); nft states probe the middle service of the
  cluster, the same for both proxies.

Per state: the median of the rounds' medians, their spread, and per endpoint the median and the
number of connections (the weights' split, seen from the client).

A first connection's latency is mostly the machine's (two processes waking each other on two
shared cores), and the rules are ~2 % of the busy CPU. `--kernel-cpu` measures the rules
themselves: during a further probe of `--kernel-connections` (16 in flight), `perf record -a -g`
samples every CPU at 20 kHz; the samples whose stack passes through nft_do_chain (chain walk,
lookups, numgen, the NAT expression), times 50 µs, divided by the connections, are the rules'
CPU per connection, and their share of the busy samples holds when the cores' speed drifts (the
same state read 10.7-17.5 µs and 1.92-2.26 % in eight probes). Needs `perf` (Debian: linux-perf).

With `--kernel-cpu` the functions under the rules are printed too (`--breakdown N`: the N with
the most samples per state, inclusive, in ns per connection).

    sudo .venv/bin/python bench/first_connections.py [--compare weights|lanes] [--rounds 10] [--connections 300] [--kernel-cpu]
    sudo .venv/bin/python bench/first_connections.py --compare kube-proxy --kube-proxy-dumps DIR --services 10000 \
        [--modes nftables,iptables] --kernel-cpu
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.backends import registry as backend_registry  # noqa: E402
from nfproxy.backends.iptables.render import JUMPS  # noqa: E402
from nfproxy.backends.nft import full as nft_full, render, structure as nft_structure  # noqa: E402
from nfproxy.core.model import ClusterState, IPFamily, Protocol, ServicePort, ServicePortName, ServiceType  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.kernel import netns as netns_mod  # noqa: E402
from nfproxy.kernel.iptables import Flavour  # noqa: E402
from nfproxy.kernel.nfacct import Nfacct  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

from kube_rules import SERVICE_CIDR, dump_name  # noqa: E402
from sync import weighted  # noqa: E402

MED = statistics.median
TODAY = (render.LANE, render.LANES_PER_MAP)
NEW_CONNECTION_CHAINS = nft_full.NEW_CONNECTION_CHAINS
ENDPOINT_CHOICE = nft_structure.endpoint_choice
BEFORE = (67_026_960, 64)
SAMPLE_HZ = 20_000
IDLE = ("pv_native_safe_halt", "default_idle", "cpuidle_enter", "do_idle")
# Where the rules run: nf_tables' chain walk, and legacy x_tables' (iptables-legacy).
RULES = ("nft_do_chain", "ipt_do_table")


def settle(quiet: float = 0.2, limit: float = 15.0) -> float:
    """Wait until the CPUs are mostly idle: the kernel frees the table a full sync replaced in a
    worker after the commit (10 000 chains, seconds of CPU), and a probe beside it measures that
    worker. Seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        before = _cpu_times()
        time.sleep(quiet)
        busy, total = (a - b for a, b in zip(_cpu_times(), before))
        if total and busy / total < 0.15:
            break
    return time.monotonic() - began


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def rules_cpu(sb: Sandbox, dst: str, port: int, connections: int) -> tuple[float, float, collections.Counter[str]]:
    """The rules' CPU per connection (µs), their share of this process's busy samples, and per
    function the samples under the rules that pass through it: perf's samples of every CPU, kept
    when they are this process's (the client and the servers are its threads, and the packets
    cross the namespaces in their softirqs) and pass through nft_do_chain (or ipt_do_table for
    iptables-legacy; a teardown worker's nft_* functions do not). Others' work on the machine
    walks rules of its own: a sample of theirs is not ours. The share holds when the shared
    cores' speed drifts (both run slower alike)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/perf.data"
        rec = subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-e", "cpu-clock", "-F", str(SAMPLE_HZ), "-o", data],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)  # perf's own start-up (seconds on a loaded machine) is not the connections'
            outcomes = sb.connect("pod", dst, port, "tcp", connections, parallel=16)
        finally:
            rec.send_signal(signal.SIGINT)
            _, err = rec.communicate(timeout=120)
        if rec.returncode not in (0, -signal.SIGINT):
            raise SystemExit(f"perf record: exit {rec.returncode}: {err.strip()}")
        assert all(o.ok for o in outcomes), outcomes[:3]
        script = subprocess.run(["perf", "script", "-i", data, "-F", "pid,ip,sym"],
                                capture_output=True, text=True, check=True).stdout
    under: collections.Counter[str] = collections.Counter()
    rules = busy = 0
    me = str(os.getpid())
    for st in script.split("\n\n"):
        lines = st.strip().splitlines()
        if not lines or lines[0].strip() != me:
            continue  # another process's packets (other work on the machine walks its own rules)
        frames = [ln.strip().split(None, 1)[-1] for ln in lines[1:]]
        if not any(idle in frames for idle in IDLE):
            busy += 1
        walk = next((i for i, f in enumerate(frames) if f in RULES), None)
        if walk is None:
            continue
        rules += 1
        under.update(set(frames[: walk + 1]))
        under[f"(self) {frames[0]}"] += 1
    if rules == 0:
        raise SystemExit(f"perf saw no sample of this process under {'/'.join(RULES)}: no kernel symbols (kptr_restrict?)")
    return rules * 1e6 / SAMPLE_HZ / connections, rules / busy, under


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """The service a state's connections go to."""

    ip: str
    port: int
    endpoints: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One state of the node: how to put its rules in the node namespace, and where to connect."""

    install: Callable[[Sandbox], None]
    target: Target
    # States of one group share a sandbox; each group has its own, so that legacy x_tables
    # tables, once made in a namespace (they stay until it goes), never sit under nft states.
    group: str = "nft"


def _in_node(sb: Sandbox, *cmd: str, stdin: str | None = None) -> None:
    done = subprocess.run(["ip", "netns", "exec", sb.node_ns, *cmd], input=stdin, text=True, capture_output=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)}: {done.stderr.strip()}")


def clear(sb: Sandbox) -> None:
    """No rules at all in the node namespace: every nf_tables table and the legacy tables."""
    _in_node(sb, "nft", "flush", "ruleset")
    names = Path("/proc/thread-self/net/ip_tables_names")
    with netns_mod.entered(sb.node_ns):  # the legacy tables this namespace has made, if any
        tables = names.read_text().split() if names.exists() else []
    for table in tables:
        _in_node(sb, "iptables-legacy", "-t", table, "-F")
        _in_node(sb, "iptables-legacy", "-t", table, "-X")


@contextlib.contextmanager
def layout(lane: tuple[int, int] = TODAY, inline_checks: bool = False, lanes_only: bool = False):  # noqa: ANN201
    """The nft renderer's constants and endpoint choice for one render, set in the modules that
    read them (backends/nft/full.py and structure.py, not the render.py facade):
    `lane` (LANE, LANES_PER_MAP); `inline_checks`: each new-connection check its own `ct state
    new` rule in filter-input and filter-forward (the layout before the morning of 2026-12-07);
    `lanes_only`: every chain in the interval lanes (before the hash maps of the afternoon)."""
    saved = [(m, name, getattr(m, name)) for m in (nft_full, nft_structure)
             for name in ("LANE", "LANES_PER_MAP", "NEW_CONNECTION_CHAINS", "endpoint_choice") if hasattr(m, name)]
    values = {"LANE": lane[0], "LANES_PER_MAP": lane[1],
              "NEW_CONNECTION_CHAINS": {} if inline_checks else NEW_CONNECTION_CHAINS,
              "endpoint_choice": (lambda units: (*nft_structure.lane_split(units), False)) if lanes_only else ENDPOINT_CHOICE}
    try:
        for m, name, _ in saved:
            setattr(m, name, values[name])
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def nfproxy_install(state: ClusterState, backend: str, lane: tuple[int, int] = TODAY,
                    inline_checks: bool = False, lanes_only: bool = False) -> Callable[[Sandbox], None]:
    """A restarted nfproxy's full sync of `state`, in the `layout` given."""
    def install(sb: Sandbox) -> None:
        clear(sb)
        flavour = Flavour.LEGACY if backend == "iptables" else None
        with layout(lane, inline_checks, lanes_only):
            proxier = Proxier(backend, netns=sb.node_ns, families=(IPFamily.V4,), flavour=flavour)  # a restart
            proxier.sync(state, full=True)
            proxier.sync(state)  # what the first one left for cleanup
    return install


def reversed_jumps(install: Callable[[Sandbox], None]) -> Callable[[Sandbox], None]:
    """nfproxy's iptables rules with the built-in chains' jumps as kernels were handed them
    before 2026-12-07: each of JUMPS inserted at the top in turn, so every chain's reversed."""
    kubelet = [j for j in JUMPS if j.spec == "-j KUBE-FIREWALL"]
    own = [j for j in JUMPS if j not in kubelet]
    old = [j for j in own if j.table == "filter"] + kubelet + [j for j in own if j.table == "nat"]  # the list then

    def again(sb: Sandbox) -> None:
        install(sb)
        for jump in old:
            spec = shlex.split(jump.spec)
            _in_node(sb, "iptables-legacy", "-t", jump.table, "-D", jump.chain, *spec)
            _in_node(sb, "iptables-legacy", "-t", jump.table, "-I", jump.chain, "1", *spec)
    return again


def dump_install(path: Path) -> Callable[[Sandbox], None]:
    def install(sb: Sandbox) -> None:
        clear(sb)
        if path.suffix == ".nft":
            _in_node(sb, "nft", "-f", str(path))
        else:
            Nfacct(sb.node_ns).ensure(render.INVALID_DROP_COUNTER)  # kube-proxy makes it before its restore
            _in_node(sb, "iptables-legacy-restore", stdin=path.read_text())
    return install


def target_of(state: ClusterState, ip: str) -> Target:
    key = next(k for k, sp in state.services.items() if sp.cluster_ip == ip)
    return Target(ip, state.services[key].port, tuple(ep.ip for ep in state.endpoints[key]))


def middle_jump(rules: str) -> str:
    """The cluster IP whose KUBE-SERVICES jump is the middle one of that chain's service jumps."""
    ips = [ln.split(" -d ", 1)[1].split(None, 1)[0].removesuffix("/32") for ln in rules.splitlines()
           if ln.startswith("-A KUBE-SERVICES ") and " -d " in ln and "-j KUBE-SVC-" in ln]
    return ips[len(ips) // 2]


def kube_state(services: int) -> ClusterState:
    """uniform_cluster as the API server holds it: the service CIDR and default/kubernetes too."""
    plain = uniform_cluster(services, 10)
    api = ServicePort(ServicePortName("default", "kubernetes", "https", Protocol.TCP), IPFamily.V4,
                      ServiceType.CLUSTER_IP, "172.16.0.1", 443)
    node = dataclasses.replace(plain.node, service_cidrs=(SERVICE_CIDR,))
    return ClusterState(node=node, services={**plain.services, api.key: api}, endpoints=plain.endpoints)


def kube_cases(services: int, dumps: Path, modes: list[str], before: bool = False) -> dict[str, Case]:
    state = kube_state(services)
    served = sorted((sp for k, sp in state.services.items() if k in state.endpoints),
                    key=lambda sp: int(sp.name.name.split("-")[1]))
    middle = target_of(state, served[len(served) // 2].cluster_ip)
    cases: dict[str, Case] = {}
    for mode in modes:
        dump = dumps / dump_name(mode, services)
        if not dump.exists():
            raise SystemExit(f"{dump}: no such dump (bench/kube_rules.py writes it)")
        if mode == "nftables":
            cases["kube-proxy nftables"] = Case(dump_install(dump), middle)
            cases["nfproxy nft"] = Case(nfproxy_install(state, "nft"), middle)
            if before:
                cases["nfproxy nft, interval lanes (before)"] = Case(nfproxy_install(state, "nft", lanes_only=True), middle)
        else:
            ours = backend_registry.backend("iptables").render(state, IPFamily.V4)
            cases["kube-proxy iptables"] = Case(dump_install(dump), target_of(state, middle_jump(dump.read_text())),
                                                "iptables")
            nf_target = target_of(state, middle_jump(ours.text()))
            cases["nfproxy iptables"] = Case(nfproxy_install(state, "iptables"), nf_target, "iptables")
            if before:
                cases["nfproxy iptables, jumps reversed (before)"] = Case(
                    reversed_jumps(nfproxy_install(state, "iptables")), nf_target, "iptables")
    return cases


def states(compare: str, plain: ClusterState) -> dict[str, Case]:
    key = sorted(plain.services, key=lambda k: (k[0].namespace, k[0].name))[0]
    target = target_of(plain, plain.services[key].cluster_ip)
    heavy = weighted(plain, [1, 2, 7])
    if compare == "lanes":
        named = {"unweighted, lane before": (plain, BEFORE), "unweighted, lane today": (plain, TODAY),
                 "1:2:7, lane before": (heavy, BEFORE), "1:2:7, lane today": (heavy, TODAY)}
    else:
        named = {"unweighted": (plain, TODAY), "1:2:7 cycled": (heavy, TODAY),
                 "nine of 1, one of 2": (weighted(plain, [1] * 9 + [2]), TODAY)}
    return {name: Case(nfproxy_install(state, "nft", lane), target) for name, (state, lane) in named.items()}


def probe(sb: Sandbox, case: Case, args: argparse.Namespace) -> tuple[list, tuple[float, float, collections.Counter[str]] | None]:
    case.install(sb)
    settle()
    t = case.target
    sb.connect("pod", t.ip, t.port, "tcp", 10)  # warm up
    outcomes = sb.connect("pod", t.ip, t.port, "tcp", args.connections, parallel=1)
    assert all(o.ok for o in outcomes), outcomes[:3]
    cpu = rules_cpu(sb, t.ip, t.port, args.kernel_connections) if args.kernel_cpu else None
    return outcomes, cpu


def report(cases: dict[str, Case], rounds: dict[str, list[float]], cpu: dict[str, list], per_endpoint: dict,
           args: argparse.Namespace) -> None:
    first = next(iter(cases))
    ref = MED(rounds[first])
    pairs = [(ref_of(name), name) for name in cases if name.startswith("nfproxy")] if args.compare == "kube-proxy" else []
    print()
    print(f"| state | first connection (µs, median of the rounds' medians) | rounds' spread | against {first} |")
    print("|---|---|---|---|")
    for name, values in rounds.items():
        print(f"| {name} | {MED(values):.1f} | {min(values):.0f}–{max(values):.0f} | {MED(values) / ref:.3f} |")
    for a, b in pairs:
        ratios = [y / x for x, y in zip(rounds[a], rounds[b])]
        print(f"{b} / {a}: {MED(rounds[b]) / MED(rounds[a]):.3f} (median of the rounds' ratios {MED(ratios):.3f}, "
              f"spread {min(ratios):.3f}–{max(ratios):.3f})")
    if args.kernel_cpu:
        us, share = ({name: [v[i] for v in got] for name, got in cpu.items()} for i in (0, 1))
        print()
        print("| state | rules' CPU per connection (µs, median of rounds) | spread | rules' share of busy CPU "
              f"(median of rounds) | spread | share against {first} |")
        print("|---|---|---|---|---|---|")
        for name in cases:
            a, b = us[name], share[name]
            print(f"| {name} | {MED(a):.2f} | {min(a):.2f}–{max(a):.2f} | {MED(b):.2%} | {min(b):.2%}–{max(b):.2%} | "
                  f"{MED(b) / MED(share[first]):.3f} |")
        for a, b in pairs:
            print(f"rules' CPU {b} / {a}: {MED(us[b]) / MED(us[a]):.3f}, share {MED(share[b]) / MED(share[a]):.3f}")
        breakdown(cases, cpu, args)
    print()
    for name, eps in per_endpoint.items():
        cells = " ".join(f"{ep.split(':')[0].rsplit('.', 1)[-1]}: {MED(v):.0f} µs ({len(v)})" for ep, v in sorted(eps.items()))
        print(f"{name} per endpoint (last octet: median, connections): {cells}")


def ref_of(name: str) -> str:
    """The kube-proxy state an nfproxy state is held to: the same mode's."""
    return "kube-proxy iptables" if "iptables" in name else "kube-proxy nftables"


def breakdown(cases: dict[str, Case], cpu: dict[str, list], args: argparse.Namespace) -> None:
    """Per function under the rules: ns per connection (all rounds' samples together)."""
    per: dict[str, dict[str, float]] = {}
    for name in cases:
        total: collections.Counter[str] = collections.Counter()
        for _, _, under in cpu[name]:
            total.update(under)
        scale = 1e9 / SAMPLE_HZ / (args.kernel_connections * len(cpu[name]))
        per[name] = {fn: n * scale for fn, n in total.items()}
    top = sorted({fn for p in per.values() for fn in sorted(p, key=p.get, reverse=True)[: args.breakdown]},
                 key=lambda fn: -max(p.get(fn, 0) for p in per.values()))
    print()
    print("| function (samples passing through it, under the rules, or its own: (self); ns per connection) | " + " | ".join(cases) + " |")
    print("|---" * (len(cases) + 1) + "|")
    for fn in top:
        print(f"| {fn} | " + " | ".join(f"{per[n].get(fn, 0):.0f}" for n in cases) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=("weights", "lanes", "kube-proxy"), default="weights")
    ap.add_argument("--kube-proxy-dumps", type=Path, help="bench/kube_rules.py's output (--compare kube-proxy)")
    ap.add_argument("--modes", default="nftables,iptables", help="--compare kube-proxy: nftables, iptables or both")
    ap.add_argument("--before", action="store_true",
                    help="--compare kube-proxy: also nfproxy's layouts before 2026-12-07 (nft: every chain in the "
                         "interval lanes; iptables: built-in chains' jumps reversed)")
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--kernel-cpu", action="store_true", help="also the rules' CPU per connection, from perf samples")
    ap.add_argument("--kernel-connections", type=int, default=4000)
    ap.add_argument("--breakdown", type=int, default=14, help="functions per state in the --kernel-cpu breakdown")
    args = ap.parse_args()
    if args.kernel_cpu and shutil.which("perf") is None:
        raise SystemExit("--kernel-cpu needs perf (Debian: apt install linux-perf)")
    if args.compare == "kube-proxy":
        if args.kube_proxy_dumps is None:
            raise SystemExit("--compare kube-proxy needs --kube-proxy-dumps DIR (bench/kube_rules.py)")
        cases = kube_cases(args.services, args.kube_proxy_dumps, args.modes.split(","), args.before)
    else:
        cases = states(args.compare, uniform_cluster(args.services, 10))
    groups = {c.group: SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                                      endpoints={ip: [(8080, "tcp")] for d in cases.values() if d.group == c.group
                                                 for ip in d.target.endpoints})
              for c in cases.values()}
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list] = {name: [] for name in cases}
    per_endpoint: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in cases}
    version = (args.kube_proxy_dumps / "kube-proxy.version").read_text().strip() if args.kube_proxy_dumps else ""
    print(f"# first connections: {args.services} x 10, {args.compare} {version}, {args.rounds} rounds of "
          f"{args.connections}, one run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    with netns_mod.interruptible(), contextlib.ExitStack() as stack:
        boxes = {group: stack.enter_context(Sandbox(spec)) for group, spec in groups.items()}
        for r in range(args.rounds):
            order: Callable = (lambda x: x) if r % 2 == 0 else reversed  # type: ignore[assignment]
            for name in order(list(cases)):
                outcomes, got = probe(boxes[cases[name].group], cases[name], args)
                rounds[name].append(MED(o.seconds for o in outcomes) * 1e6)
                for o in outcomes:
                    per_endpoint[name][o.endpoint or "?"].append(o.seconds * 1e6)
                if got is not None:
                    cpu[name].append(got)
                print(f"round {r + 1} {name}: {rounds[name][-1]:.1f} µs"
                      + (f", rules {got[0]:.2f} µs CPU per connection, {got[1]:.2%} of busy CPU" if got else ""),
                      flush=True)
    report(cases, rounds, cpu, per_endpoint, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
