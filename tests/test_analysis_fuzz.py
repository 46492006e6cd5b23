"""`check` and `trace` on hundreds of corrupted dumps: a clean error or an answer, never a
traceback or a hang (issue J).

A seeded mutator (deterministic: the same cases on every run) corrupts real dumps of both kinds,
the upstream kube-proxy dumps in tests/dumps/ and nfproxy's own `render --backend iptables`
output (IPv4 and IPv6 in one stream): truncation, deleted, repeated and swapped lines, junk
tokens (out-of-range probabilities, NaN, huge numbers), binary bytes, and for JSON structural
damage (missing keys, values of the wrong type, deep nesting, absurd numgen moduli). Each case
runs in-process through `nfproxy.cli.main.main` under a 30 s alarm that only a hang can reach.
"""

from __future__ import annotations

import copy
import json
import random
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nfproxy.cli.commands.render import render_text
from nfproxy.cli.main import main
from nfproxy.core.model import NodeConfig
from nfproxy.sources import manifests

ROOT = Path(__file__).resolve().parent.parent
DUMPS = Path(__file__).resolve().parent / "dumps"
SEED = 20261201
CASES_PER_DUMP = 80
JUNK = ["1.5", "-0.1", "NaN", "inf", "-inf", "1e999", "0x", "99999999999999999999", "", "!", "-j", "\"", "[0:0]",
        "*nat", "COMMIT", ":", "-A", "10.0.0.1/99", "::1::2", "65536", "-1", "--probability", "☃"]
JSON_JUNK: list[Any] = [None, 0, -1, 2**64, 1.5, float("nan"), "", "x", [], {}, [[]], {"x": 1}, True, "@nowhere"]


class Hang(Exception):
    pass


def seeds() -> list[tuple[str, str]]:
    state = manifests.load(str(ROOT / "examples"), NodeConfig()).state
    out = [(p.name, p.read_text()) for p in sorted(DUMPS.iterdir()) if p.suffix in (".txt", ".json")]
    out.append(("render-iptables.txt", render_text("iptables", state)))
    return out


def text_mutations(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(8)
        i = rng.randrange(len(lines)) if lines else 0
        if op == 0 and lines:
            lines = lines[: i]  # truncated at a line
        elif op == 1 and lines:
            cut = rng.randrange(len(text))
            return text[:cut]  # truncated mid-line
        elif op == 2 and lines:
            del lines[i]
        elif op == 3 and lines:
            lines.insert(rng.randrange(len(lines)), lines[i])
        elif op == 4 and len(lines) > 1:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op in (5, 6) and lines:
            tokens = lines[i].split(" ")
            tokens[rng.randrange(len(tokens))] = rng.choice(JUNK)
            lines[i] = " ".join(tokens)
        else:
            pos = rng.randrange(len(text) + 1)
            return text[:pos] + rng.choice(["\x00", "\ufffd", "\x1b[0m", "\udcff"[:0] + "\x7f"]) + text[pos:]
    return "\n".join(lines) + "\n"


def _nodes(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def json_mutation(text: str, rng: random.Random) -> str:
    doc = json.loads(text)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _nodes(doc) if p]
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        last = path[-1]
        op = rng.randrange(5)
        if op == 0:
            del parent[last]
        elif op == 1:
            parent[last] = copy.deepcopy(rng.choice(JSON_JUNK))
        elif op == 2:
            deep: Any = 1
            for _ in range(rng.choice([50, 5000, 100000])):
                deep = [deep]
            parent[last] = deep
            break  # nothing to walk into after this
        elif op == 3 and last in ("mod", "offset", "prio", "timeout", "len"):
            parent[last] = rng.choice([0, -1, 2**32, 2**64, "3"])
        else:
            parent[last] = copy.deepcopy(parent[rng.choice(list(parent.keys()) if isinstance(parent, dict) else range(len(parent)))])
    try:
        return json.dumps(doc)
    except (ValueError, RecursionError):
        return text[: len(text) // 2]


def cases() -> Iterator[tuple[str, bool, str]]:
    """(name, is_json, corrupted text), CASES_PER_DUMP per seed dump."""
    rng = random.Random(SEED)
    for name, text in seeds():
        is_json = name.endswith(".json")
        for k in range(CASES_PER_DUMP):
            if is_json and k % 2 == 0:
                yield f"{name}#{k}", True, json_mutation(text, rng)
            else:
                yield f"{name}#{k}", is_json, text_mutations(text, rng)


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_case(path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(30)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
    return code, capsys.readouterr().err


def test_corrupted_dumps_give_clean_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failures: list[str] = []
    count = 0
    errors = 0
    for name, is_json, text in cases():
        path = tmp_path / "dump"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        count += 1
        for argv in (["check", "--from-file", str(path)],
                     ["trace", "--from-file", str(path), "10.0.1.1", "172.30.0.41:80/tcp"]):
            try:
                code, err = run_case(path, argv, capsys)
            except Hang:
                failures.append(f"{name} {argv[0]}: still running after 30 s")
                continue
            except BaseException as exc:  # noqa: BLE001 - a traceback is what this test looks for
                failures.append(f"{name} {argv[0]}: {type(exc).__name__}: {exc}"[:300])
                continue
            if code == 2:
                errors += 1
                if not err.startswith(f"nfproxy: error: {path}"):
                    failures.append(f"{name} {argv[0]}: error does not name the file: {err[:200]!r}")
                elif not is_json and not re.match(rf"nfproxy: error: {re.escape(str(path))}:\d+: ", err) \
                        and not re.search(r": (empty|no \*table|holds no IPv)", err):
                    failures.append(f"{name} {argv[0]}: iptables error without a line: {err[:200]!r}")
            elif code not in (0, 1):
                failures.append(f"{name} {argv[0]}: exit {code}")
            if "Traceback" in err:
                failures.append(f"{name} {argv[0]}: traceback on stderr")
    assert count >= 300
    assert errors > count // 2  # most corruptions are caught as errors, not read as rules
    assert not failures, f"{len(failures)} of {2 * count} runs failed:\n" + "\n".join(failures[:40])
