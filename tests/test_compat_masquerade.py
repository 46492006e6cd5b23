"""How the kernel runner tells masquerade apart from conntrack's own port remaps (no root)."""

from __future__ import annotations

from tests.compat_kernel import _masquerade_problems
from nfproxy.verify.sandbox import Outcome

NODE_IP = "192.168.0.2"


def _flows(kept: int, ported: int, moved: int = 0) -> list[Outcome]:
    same = [Outcome("ok", "10.0.0.1:80", NODE_IP, 40000 + i, client_port=40000 + i)
            for i in range(kept)]
    remapped = [Outcome("ok", "10.0.0.1:80", NODE_IP, 50000 + i, client_port=40000 + i)
                for i in range(ported)]
    masqueraded = [Outcome("ok", "10.0.0.1:80", "10.9.9.9", 40000 + i, client_port=40000 + i)
                   for i in range(moved)]
    return same + remapped + masqueraded


def test_a_clash_remap_of_the_nodes_port_is_not_masquerade() -> None:
    assert _masquerade_problems(_flows(79, 1), False, NODE_IP, node=True) == []


def test_the_node_with_most_ports_rewritten_was_masqueraded() -> None:
    assert _masquerade_problems(_flows(1, 79), True, NODE_IP, node=True) == []
    assert _masquerade_problems(_flows(1, 79), False, NODE_IP, node=True) != []
    assert _masquerade_problems(_flows(79, 1), True, NODE_IP, node=True) != []


def test_a_changed_address_is_masquerade_for_any_client() -> None:
    assert _masquerade_problems(_flows(79, 0, moved=1), False, NODE_IP, node=True) != []
    assert _masquerade_problems(_flows(79, 0, moved=1), False, NODE_IP, node=False) != []
    assert _masquerade_problems(_flows(0, 0, moved=80), True, NODE_IP, node=False) == []


def test_port_rewrites_alone_say_nothing_for_other_clients() -> None:
    assert _masquerade_problems(_flows(40, 40), False, NODE_IP, node=False) == []
    assert _masquerade_problems(_flows(40, 40), True, NODE_IP, node=False) != []
