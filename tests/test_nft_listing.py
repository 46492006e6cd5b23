"""Reading nft's JSON listings back: an unreadable one is a KernelError that names the listing
(nft 1.0.6 prints invalid JSON for a table another process owns: the daemon logged only
`Expecting value: line 2 column 1 (char 180)`)."""

from __future__ import annotations

import pytest

from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import KernelError


class _Printing(NftSession):
    """A session whose nft prints `out` for every command (no kernel, no bindings)."""

    def __init__(self, out: str) -> None:
        super().__init__(None, use_bindings=False)
        self.out = out

    def _cmd(self, text: str, *, json_output: bool = False, terse: bool = False) -> str:
        return self.out


@pytest.mark.parametrize(("call", "named"), [
    (lambda s: s.list_table("ip", "nfproxy"), "`nft -j list table ip nfproxy`"),
    (lambda s: s.list_ruleset(), "`nft -j list ruleset`"),
])
def test_an_unreadable_listing_names_itself(call, named: str) -> None:  # noqa: ANN001
    session = _Printing('{"nftables": [{"table": {"family": "ip", "name": "t", "flags": }}]}\n')
    with pytest.raises(KernelError) as caught:
        call(session)
    assert str(caught.value).startswith(f"{named} printed JSON that cannot be read (Expecting value: line 1")


def test_a_readable_listing_is_read() -> None:
    assert _Printing('{"nftables": []}').list_table("ip", "nfproxy") == {"nftables": []}
