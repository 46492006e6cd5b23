"""NftSession.release: libnftables' context (and the ruleset cache it keeps between commands)
is dropped after a big transaction; the next command makes a new one, in the same namespace."""

from __future__ import annotations

import pytest

from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftSession

pytestmark = pytest.mark.kernel


def test_a_released_session_goes_on_in_its_own_namespace() -> None:
    with netns.throwaway("nfp-sess-a") as a, netns.throwaway("nfp-sess-b") as b:
        session = NftSession(a)
        assert session.uses_bindings, "libnftables bindings missing: the node path is untested"
        session.apply("add table ip nfp-sess\nadd chain ip nfp-sess c")
        session.release()
        assert session._ctx is None
        doc = session.list_table("ip", "nfp-sess")  # a new context, made inside `a`
        assert doc is not None and any("chain" in o for o in doc["nftables"])
        session.release()
        session.apply("add chain ip nfp-sess d")
        assert NftSession(b).list_table("ip", "nfp-sess") is None  # nothing leaked into `b`
        names = NftSession(a).object_names("ip", "nfp-sess")
        assert names is not None and names[0] == {"c", "d"}
