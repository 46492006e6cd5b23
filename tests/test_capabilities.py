"""Commands that program the kernel ask for capabilities, not for uid 0 (no root needed here)."""

from nfproxy.kernel import capabilities as caps

STATUS = "Name:\tnfproxy\nCapInh:\t0000000000003000\nCapEff:\t{mask}\nCapBnd:\t0000000000003000\n"


def test_the_node_images_capabilities_are_enough_for_the_daemon() -> None:
    status = STATUS.format(mask="0000000000003000")  # NET_ADMIN and NET_RAW, as podman grants
    assert caps.missing(caps.CAP_NET_ADMIN, caps.CAP_NET_RAW, status=status) == []
    assert caps.missing(caps.CAP_NET_ADMIN, caps.CAP_SYS_ADMIN, status=status) == ["CAP_SYS_ADMIN"]


def test_no_capabilities_names_each_missing_one() -> None:
    status = STATUS.format(mask="0000000000000000")
    assert caps.missing(caps.CAP_NET_ADMIN, caps.CAP_NET_RAW, status=status) == [
        "CAP_NET_ADMIN", "CAP_NET_RAW"]
    assert caps.effective("no such line") == 0
