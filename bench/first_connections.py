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
  cluster unweighted and with 1:2:7 (render.LANE/LANES_PER_MAP set for this process only).

Per state: the median of the rounds' medians, their spread, and per endpoint the median and the
number of connections (the weights' split, seen from the client).

A first connection's latency is mostly the machine's (two processes waking each other on two
shared cores), and the rules are ~2 % of the busy CPU. `--kernel-cpu` measures the rules
themselves: during a further probe of `--kernel-connections` (16 in flight), `perf record -a -g`
samples every CPU at 20 kHz; the samples whose stack passes through nft_do_chain (chain walk,
lookups, numgen, the NAT expression), times 50 µs, divided by the connections, are the rules'
CPU per connection, and their share of the busy samples holds when the cores' speed drifts (the
same state read 10.7-17.5 µs and 1.92-2.26 % in eight probes). Needs `perf` (Debian: linux-perf).

    sudo .venv/bin/python bench/first_connections.py [--compare weights|lanes] [--rounds 10] [--connections 300] [--kernel-cpu]
"""

from __future__ import annotations

import argparse
import collections
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

from nfproxy.backends.nft import render  # noqa: E402
from nfproxy.core.model import ClusterState  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

from sync import weighted  # noqa: E402

MED = statistics.median
TODAY = (render.LANE, render.LANES_PER_MAP)
BEFORE = (67_026_960, 64)
SAMPLE_HZ = 20_000
IDLE = ("pv_native_safe_halt", "default_idle", "cpuidle_enter", "do_idle")


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


def rules_cpu(sb: Sandbox, dst: str, port: int, connections: int) -> tuple[float, float]:
    """The rules' CPU per connection (µs) and their share of the busy samples: perf's samples
    of every CPU whose stack passes through nft_do_chain (a teardown worker's nft_* functions do
    not). The share holds when the shared cores' speed drifts (both run slower alike)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/perf.data"
        rec = subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-e", "cpu-clock", "-F", str(SAMPLE_HZ), "-o", data],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            outcomes = sb.connect("pod", dst, port, "tcp", connections, parallel=16)
        finally:
            rec.send_signal(signal.SIGINT)
            _, err = rec.communicate(timeout=60)
        if rec.returncode not in (0, -signal.SIGINT):
            raise SystemExit(f"perf record: exit {rec.returncode}: {err.strip()}")
        assert all(o.ok for o in outcomes), outcomes[:3]
        script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"],
                                capture_output=True, text=True, check=True).stdout
    stacks = [st for st in script.split("\n\n") if st.strip()]
    rules = sum(1 for st in stacks if "nft_do_chain" in st)
    busy = sum(1 for st in stacks if not any(idle in st for idle in IDLE))
    if rules == 0:
        raise SystemExit(f"perf saw no sample under nft_do_chain in {len(stacks)}: no kernel symbols (kptr_restrict?)")
    return rules * 1e6 / SAMPLE_HZ / connections, rules / busy


def states(compare: str, plain: ClusterState) -> dict[str, tuple[ClusterState, tuple[int, int]]]:
    heavy = weighted(plain, [1, 2, 7])
    if compare == "lanes":
        return {"unweighted, lane before": (plain, BEFORE), "unweighted, lane today": (plain, TODAY),
                "1:2:7, lane before": (heavy, BEFORE), "1:2:7, lane today": (heavy, TODAY)}
    return {"unweighted": (plain, TODAY), "1:2:7 cycled": (heavy, TODAY),
            "nine of 1, one of 2": (weighted(plain, [1] * 9 + [2]), TODAY)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=("weights", "lanes"), default="weights")
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--kernel-cpu", action="store_true", help="also the rules' CPU per connection, from perf samples")
    ap.add_argument("--kernel-connections", type=int, default=4000)
    args = ap.parse_args()
    if args.kernel_cpu and shutil.which("perf") is None:
        raise SystemExit("--kernel-cpu needs perf (Debian: apt install linux-perf)")
    plain = uniform_cluster(args.services, 10)
    cases = states(args.compare, plain)
    key = sorted(plain.services, key=lambda k: (k[0].namespace, k[0].name))[0]
    svc = plain.services[key]
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ep.ip: [(8080, "tcp")] for ep in plain.endpoints[key]})
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    per_endpoint: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in cases}
    print(f"# first connections: {args.services} x 10, {args.compare}, {args.rounds} rounds of "
          f"{args.connections}, one run", flush=True)
    with Sandbox(spec) as sb:
        for r in range(args.rounds):
            order: Callable = (lambda x: x) if r % 2 == 0 else reversed  # type: ignore[assignment]
            for name in order(list(cases)):
                state, lane = cases[name]
                render.LANE, render.LANES_PER_MAP = lane
                proxier = Proxier("nft", netns=sb.node_ns)  # a restart: the lanes are laid out anew
                proxier.sync(state, full=True)
                proxier.sync(state)  # what the first one left for cleanup
                settle()
                sb.connect("pod", svc.cluster_ip, svc.port, "tcp", 10)  # warm up
                outcomes = sb.connect("pod", svc.cluster_ip, svc.port, "tcp", args.connections, parallel=1)
                assert all(o.ok for o in outcomes), outcomes[:3]
                rounds[name].append(MED(o.seconds for o in outcomes) * 1e6)
                for o in outcomes:
                    per_endpoint[name][o.endpoint or "?"].append(o.seconds * 1e6)
                if args.kernel_cpu:
                    cpu[name].append(rules_cpu(sb, svc.cluster_ip, svc.port, args.kernel_connections))
                print(f"round {r + 1} {name}: {rounds[name][-1]:.1f} µs"
                      + (f", rules {cpu[name][-1][0]:.2f} µs CPU per connection, {cpu[name][-1][1]:.2%} of busy CPU"
                         if args.kernel_cpu else ""), flush=True)
    render.LANE, render.LANES_PER_MAP = TODAY
    first = next(iter(cases))
    ref = MED(rounds[first])
    print()
    print(f"| state | first connection (µs, median of the rounds' medians) | rounds' spread | against {first} |")
    print("|---|---|---|---|")
    for name, values in rounds.items():
        print(f"| {name} | {MED(values):.1f} | {min(values):.0f}–{max(values):.0f} | {MED(values) / ref:.3f} |")
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
    print()
    for name, eps in per_endpoint.items():
        cells = " ".join(f"{ep.split(':')[0].rsplit('.', 1)[-1]}: {MED(v):.0f} µs ({len(v)})" for ep, v in sorted(eps.items()))
        print(f"{name} per endpoint (last octet: median, connections): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
