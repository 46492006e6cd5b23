"""Rule templates (kernel/nft_rule_templates.py): a templated rule is byte for byte what the
compiler makes of it, and a shape whose numbers cannot be found is compiled every time."""

from __future__ import annotations

import dataclasses
import random

import pytest

from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns, nft_bulk
from nfproxy.kernel.nft import NftKernel
from nfproxy.kernel.nfnetlink.values import TYPE_INET_SERVICE, TYPE_INTEGER, TYPE_IPV4, Field, SetType
from nfproxy.kernel.nft_rule_templates import RuleTemplates
from nfproxy.nftables import Transaction
from nfproxy.nftables import expr as x
from nfproxy.testing import random_cluster, uniform_cluster
from tests.test_nft_bulk import capture_sends

_SLOTS = SetType("slots", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV4, 4), Field(TYPE_INET_SERVICE, 2)), False, True)


def _compiler() -> nft_bulk._Compiler:
    return nft_bulk._Compiler(Transaction("ip", "nfproxy"), {"slots": _SLOTS}.__getitem__)  # type: ignore[arg-type]


def _bodies(rng: random.Random) -> list[str]:
    out = []
    for _ in range(300):
        a = ".".join(str(rng.choice([0, 1, 9, 90, 165, 200, 255, rng.randrange(256)])) for _ in range(4))
        lane = rng.choice([0, 1, 63, 64, 255, 256, 65535, 65536, 67026960, 4227858432 // 67026960 * 67026960])
        port = rng.choice([1, 80, 90, 255, 256, 8080, 65535])
        out += [
            f"ip daddr {a} ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
            f"meta l4proto tcp dnat ip to numgen random mod {rng.choice([2, 3, 10, 90, 67026960])} offset {lane} map @slots",
            f"ip saddr {a} jump mark-for-masquerade",
            f"ip daddr {a} ip saddr {a} jump chain-{port}",
        ]
    return out


def test_templated_rules_are_the_compiled_bytes() -> None:
    compiler = _compiler()
    templates = RuleTemplates(compiler.rule_body)
    used = 0
    for body in _bodies(random.Random(7)):
        got = templates.body(body)
        assert got is not None, body
        assert got == compiler.rule_body(body), body
        used += 1
    shapes = templates._known
    assert used == 1200
    assert len(shapes) < used / 5  # shapes per byte length (and addresses 0.x, words), not one per rule
    assert all(t is not None for t in shapes.values())
    one = RuleTemplates(compiler.rule_body)
    for lane in range(1, 60):  # one shape: both numbers are written into its bytes
        body = f"meta l4proto tcp dnat ip to numgen random mod 67026960 offset {lane * 67026960} map @slots"
        assert one.body(body) == compiler.rule_body(body)
    assert [len(t.slots) for t in one._known.values() if t is not None] == [2]


def test_maps_of_one_type_share_a_template() -> None:
    """Endpoint maps the batch declares are a slot of the shape: one template per name length
    and type, its bytes the compiler's for every map; a map of another type has its own."""
    compiler = _compiler()
    other = dataclasses.replace(_SLOTS, key=(Field(TYPE_INTEGER, 4, False),))
    names = [f"endpoints-tcp-ranges-{i}" for i in range(120)]
    compiler.new_sets.update({name: dataclasses.replace(_SLOTS, name=name) for name in names})
    compiler.new_sets["endpoints-udp-ranges-7"] = dataclasses.replace(other, name="endpoints-udp-ranges-7")
    templates = RuleTemplates(compiler.rule_body, compiler.map_kind)
    bodies = [f"meta l4proto tcp dnat ip to numgen random mod 67026960 offset {k * 67026960} map @{name}"
              for name in [*names, "endpoints-udp-ranges-7"] for k in (1, 5)]
    for body in bodies:
        assert templates.body(body) == compiler.rule_body(body), body
    learned = [shape for shape, t in templates._known.items() if t is not None]
    assert len(learned) == 4  # names of 22 and 23 characters, and the map of another type
    assert len(templates._known) == 4


def _port(n: int) -> x.Body:
    return x.body(x.Match(x.TH_DPORT, n))


def test_a_name_the_compiler_does_not_copy_is_not_templated() -> None:
    """A compiler whose bytes depend on a map's name other than by copying it: compiled every time."""
    hashed = RuleTemplates(lambda body, aliases=None: str(hash(body[0].set)).encode(), lambda name: "maps")
    assert hashed.body(x.body(x.Lookup(x.TH_DPORT, "abc"))) is None
    assert hashed.body(x.body(x.Lookup(x.TH_DPORT, "abd"))) is None


def test_a_number_that_is_not_one_plain_field_is_not_templated() -> None:
    """A compiler that writes the number twice, or as text: the shape is compiled every time."""
    twice = RuleTemplates(lambda body: (body[0].right * 2).to_bytes(4, "big") + body[0].right.to_bytes(4, "big"))
    assert twice.body(_port(300)) is None
    assert twice.body(_port(301)) is None
    text = RuleTemplates(lambda body: str(body[0].right).encode())
    assert text.body(_port(300)) is None


def test_zero_is_part_of_the_shape() -> None:
    """`offset 0` may be said without the attribute: it is never written into a template made
    from another value (and the other way round)."""
    calls: list[int] = []

    def compile_body(body: tuple[x.Match]) -> bytes:
        n = body[0].right
        calls.append(n)
        return b"" if n == 0 else n.to_bytes(4, "big")

    templates = RuleTemplates(compile_body)
    assert templates.body(_port(7)) == (7).to_bytes(4, "big")
    assert templates.body(_port(0)) == b""
    assert templates.body(_port(9)) == (9).to_bytes(4, "big")
    assert templates.body(_port(300)) == (300).to_bytes(4, "big")  # two bytes: a shape of its own
    assert calls == [7, 93, 0, 300, 374]


@pytest.mark.kernel
def test_a_full_sync_with_templates_is_the_batch_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole batch of a full sync, rules of every shape the renderer writes (both
    families, node ports, affinity, firewalls), with and without templates."""
    state = random_cluster(random.Random(3), 150)
    big = uniform_cluster(200, 10)
    sent = capture_sends(monkeypatch, lambda batch: bytes(batch.data))
    real_body = RuleTemplates.body
    filled: list[int] = []

    def counted(self: RuleTemplates, text: str) -> bytes | None:
        got = real_body(self, text)
        filled.append(got is not None)
        return got

    monkeypatch.setattr(RuleTemplates, "body", counted)
    for templated in (True, False):
        if not templated:
            monkeypatch.setattr(RuleTemplates, "body", lambda self, text: None)
        for cluster in (state, big):
            with netns.throwaway("nfp-tpl") as ns:
                Proxier("nft", netns=ns, kernels=lambda f, ns=ns: NftKernel(f, netns=ns, netlink=True)).sync(cluster)
    half = len(sent) // 2
    assert half >= 3 and len(sent) == 2 * half
    assert sent[:half] == sent[half:]
    assert sum(filled) > 400  # the 200 x 10 cluster's two rules per service, at least
