"""What an endpoint change costs the kernel in each endpoint-choice form, at 10 000 x 10 (issue S).

bench/nft_layout_variants.py writes the variants' scripts (`--keep DIR`); this loads one of them
into a throwaway namespace and times, in the kernel, the batches a change sends for the middle
service (ns-0/svc-5000): the `sendmsg` of `nft -f BATCH` that carries the batch (nfnetlink
processes and commits it in that call, whole-table validation included), as `strace -T` reports
it, so nft's own parsing and cache fill are outside the figure. Forms:

- `today` (interval lanes): the endpoint count 10 -> 11 and back is element-only (10 ranges
  deleted, 11 added); a pod replaced is one range deleted and added with the new address;
- `hash-sized-counted` (plain hash map, `mod n`): 10 -> 11 is a one-rule replace (the DNAT rule
  with `mod 11`, by handle) and one element added, back the same; a pod replaced is one key
  deleted and added.

Every change is undone by the next batch; `--repeat` pairs, medians.

    sudo .venv/bin/python bench/nft_endpoint_change.py --scripts DIR [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

CHAIN = "service-W77HV3UJ-ns-0/svc-5000/tcp/http"
LANE = 223_423_200
OFFSET = 3_127_924_800
NS = f"nfp-lv-chg-{os.getpid()}"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def kernel_ms(batch: str) -> float:
    """The longest sendmsg of `nft -f` (the batch itself), in ms."""
    with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
        f.write(batch)
    try:
        done = subprocess.run(["strace", "-f", "-T", "-e", "trace=sendmsg", "ip", "netns", "exec", NS, "nft", "-f", f.name],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode:
        raise SystemExit(f"nft -f: {done.stderr[-2000:]}")
    times = [float(t) for t in re.findall(r"<(\d+\.\d+)>", done.stderr)]
    return max(times) * 1e3


def ranges(n: int) -> list[tuple[int, int]]:
    w = LANE // n
    return [(OFFSET + i * w, OFFSET + (i + 1) * w - 1) for i in range(n)]


def eps(n: int) -> list[str]:
    return [f"10.19.136.{10 if i == 0 else i} . 8080" for i in range(n)]


def today_batches() -> dict[str, tuple[str, str]]:
    m = "endpoints-counted-tcp-ranges-2"
    def count(a: int, b: int) -> str:
        dele = ", ".join(f"{lo}-{hi}" for lo, hi in ranges(a))
        add = ", ".join(f"{lo}-{hi} : {v}" for (lo, hi), v in zip(ranges(b), eps(b)))
        return f"delete element ip nfproxy {m} {{ {dele} }}\nadd element ip nfproxy {m} {{ {add} }}\n"
    lo, hi = ranges(10)[3]
    pod = lambda a, b: (f"delete element ip nfproxy {m} {{ {lo}-{hi} }}\n"  # noqa: E731
                        f"add element ip nfproxy {m} {{ {lo}-{hi} : 10.19.136.{b} . 8080 }}\n")
    return {"count 10 <-> 11": (count(10, 11), count(11, 10)), "pod replaced": (pod(3, 99), pod(99, 3))}


def hash_batches(handle: int) -> dict[str, tuple[str, str]]:
    m = "endpoints-counted-tcp-hash-2"
    rule = f"replace rule ip nfproxy {CHAIN} handle {handle} meta l4proto tcp dnat ip to numgen random mod {{n}} offset {OFFSET} map @{m}\n"
    up = rule.format(n=11) + f"add element ip nfproxy {m} {{ {OFFSET + 10} : 10.19.136.11 . 8080 }}\n"
    down = rule.format(n=10) + f"delete element ip nfproxy {m} {{ {OFFSET + 10} }}\n"
    key = OFFSET + 3
    pod = lambda b: (f"delete element ip nfproxy {m} {{ {key} }}\n"  # noqa: E731
                     f"add element ip nfproxy {m} {{ {key} : 10.19.136.{b} . 8080 }}\n")
    return {"count 10 <-> 11": (up, down), "pod replaced": (pod(99), pod(3))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scripts", type=Path, required=True, help="bench/nft_layout_variants.py --keep DIR")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--forms", default="today,hash-sized-counted")
    args = ap.parse_args()
    subprocess.run(["ip", "netns", "add", NS], check=True)
    try:
        for form in args.forms.split(","):
            sh("ip", "netns", "exec", NS, "nft", "flush", "ruleset")
            sh("ip", "netns", "exec", NS, "nft", "-f", str(args.scripts / f"nfproxy-{form}-10000.nft"))
            if form == "today":
                batches = today_batches()
            else:
                listed = sh("ip", "netns", "exec", NS, "nft", "-a", "list", "chain", "ip", "nfproxy", CHAIN)
                handle = int(re.search(r"dnat ip to numgen.*# handle (\d+)", listed)[1])
                batches = hash_batches(handle)
            for name, (there, back) in batches.items():
                got = []
                for _ in range(args.repeat):
                    got += [kernel_ms(there), kernel_ms(back)]
                print(f"{form}: {name}: kernel {statistics.median(got):.2f} ms median, {min(got):.2f} min "
                      f"({len(got)} batches)", flush=True)
            one = "ip daddr 192.0.2.1 drop"  # the floor bench's one-rule batch: whole-table validation
            sh("ip", "netns", "exec", NS, "nft", "add", "chain", "ip", "nfproxy", "lv-probe")
            got = [kernel_ms(f"add rule ip nfproxy lv-probe {one}\nflush chain ip nfproxy lv-probe\n") for _ in range(args.repeat)]
            print(f"{form}: one-rule batch (validation floor): kernel {statistics.median(got):.2f} ms median, "
                  f"{min(got):.2f} min", flush=True)
    finally:
        subprocess.run(["ip", "netns", "del", NS])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
