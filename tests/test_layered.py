"""Layered maps (backends/nft/layered.py): a partial sync's ruleset shares the previous one's big
maps. Whatever sequence of changes, a Layered map reads exactly as the dict it stands for, and
the map it evolved from is left as it was."""

from __future__ import annotations

import random

import pytest

from nfproxy.backends.nft.layered import GONE, Counts, Layered, layered


def _check(m: Layered, want: dict) -> None:
    assert dict(m) == want
    assert len(m) == len(want)
    assert sorted(m) == sorted(want)
    for k in range(-5, 300):
        assert (k in m) == (k in want)
        assert m.get(k) == want.get(k)
    with pytest.raises(KeyError):
        m[10_000]


@pytest.mark.parametrize("seed", range(8))
def test_evolving_reads_as_the_dict_and_leaves_the_old_map_alone(seed: int) -> None:
    rng = random.Random(seed)
    want = {k: rng.randrange(5) for k in range(rng.randrange(0, 200))}
    m = layered(dict(want))
    history = [(m, dict(want))]
    for _ in range(60):
        changes: dict = {}
        for _ in range(rng.randrange(1, 40)):
            k = rng.randrange(260)
            if rng.random() < 0.4:
                changes[k] = GONE
            else:
                changes[k] = rng.randrange(5)
        m = m.evolve(changes)
        for k, v in changes.items():
            if v is GONE:
                want.pop(k, None)
            else:
                want[k] = v
        _check(m, want)
        history.append((m, dict(want)))
    for old, was in history:  # every earlier map still reads as it did
        _check(old, was)


def test_the_layer_is_folded_into_a_new_base_once_it_grows() -> None:
    base = {k: k for k in range(1000)}
    m = layered(base)
    small = m.evolve({k: -k for k in range(50)})
    assert small._base is base and len(small._layer) == 50  # shared, not copied
    big = small.evolve({k: -k for k in range(50, 200)})
    assert big._base is not base and not big._layer  # folded: 200 changes > 1000 / 8
    assert big[150] == -150 and big[500] == 500 and base[150] == 150


def test_counts_drop_what_reaches_zero() -> None:
    refs = Counts({"a": 1, "b": 2})
    refs.add("a", -1)
    refs.add("b", -1)
    refs.add("c", 1)
    refs.add("c", 1)
    assert dict(refs.result()) == {"b": 1, "c": 2}
