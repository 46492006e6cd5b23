"""Hostile input end to end: nothing a manifest says reaches rule text unescaped.

Every hostile value carries the marker "evil", so a search of the rendered rules for it proves
that no such byte sequence got through; the kernel must still accept what is rendered.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.model import IPFamily, Protocol, ServicePort, ServicePortName, ServiceType
from nfproxy.sources import manifests
from nfproxy.verify.validate import apply_iptables, apply_nft

HOSTILE = [
    'evil"quote',
    "evil'quote",
    "evil\n-A INPUT -j DROP",
    "evil\r\nCOMMIT",
    "evil; flush ruleset",
    "evil # comment",
    "evil{brace",
    "evil}brace",
    "évil-ünïcode-evil",
    "evil" * 80,
    "evil\\backslash",
    "evil\x00nul",
    "$(evil)",
    "evil with spaces",
]

GOOD_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "shop"},
    "spec": {
        "type": "LoadBalancer",
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
        "externalIPs": ["198.51.100.7"],
        "loadBalancerSourceRanges": ["203.0.113.0/24"],
        "sessionAffinity": "ClientIP",
    },
    "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}},
}
GOOD_SLICE = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {"name": "web-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
    "addressType": "IPv4",
    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    "endpoints": [
        {"addresses": ["10.244.0.5"], "nodeName": "node-a", "zone": "zone-a"},
        {"addresses": ["10.244.1.5"], "nodeName": "node-b"},
    ],
}

# Where a user can put a string: (object, path). Each gets every hostile value in turn.
FIELDS = [
    ("svc", ["metadata", "name"]),
    ("svc", ["metadata", "namespace"]),
    ("svc", ["metadata", "annotations", "note"]),
    ("svc", ["metadata", "labels", "app"]),
    ("svc", ["spec", "ports", 0, "name"]),
    ("svc", ["spec", "ports", 0, "protocol"]),
    ("svc", ["spec", "ports", 0, "port"]),
    ("svc", ["spec", "clusterIP"]),
    ("svc", ["spec", "externalIPs", 0]),
    ("svc", ["spec", "loadBalancerSourceRanges", 0]),
    ("svc", ["spec", "sessionAffinity"]),
    ("svc", ["spec", "externalTrafficPolicy"]),
    ("svc", ["status", "loadBalancer", "ingress", 0, "ip"]),
    ("slice", ["metadata", "name"]),
    ("slice", ["metadata", "labels", "kubernetes.io/service-name"]),
    ("slice", ["ports", 0, "name"]),
    ("slice", ["endpoints", 0, "addresses", 0]),
    ("slice", ["endpoints", 0, "nodeName"]),
    ("slice", ["endpoints", 0, "zone"]),
]


def _set(obj: dict, path: list, value: object) -> None:
    for key in path[:-1]:
        obj = obj.setdefault(key, {}) if isinstance(key, str) else obj[key]
    obj[path[-1]] = value


def hostile_documents() -> list[dict]:
    """One good service and slice in `shop`, and a hostile copy per (field, value) elsewhere."""
    docs = [copy.deepcopy(GOOD_SERVICE), copy.deepcopy(GOOD_SLICE)]
    for i, (which, path) in enumerate(FIELDS):
        for j, value in enumerate(HOSTILE):
            svc = copy.deepcopy(GOOD_SERVICE)
            sl = copy.deepcopy(GOOD_SLICE)
            ns = f"ns-{i}-{j}"
            svc["metadata"]["namespace"] = sl["metadata"]["namespace"] = ns
            svc["spec"]["clusterIP"] = f"10.97.{i}.{j + 1}"
            svc["spec"]["ports"][0]["nodePort"] = 30100 + i * len(HOSTILE) + j
            _set(svc if which == "svc" else sl, path, value)
            docs += [svc, sl]
    return docs


def _hostile_state(tmp_path: Path):  # noqa: ANN202
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump_all(hostile_documents(), allow_unicode=True))
    return manifests.load(path).state


@pytest.mark.kernel
def test_hostile_manifests_rendering_is_accepted_by_the_kernel(tmp_path: Path, netns: str) -> None:
    """What is rendered is accepted by the kernel, in a namespace of our own."""
    state = _hostile_state(tmp_path)
    apply_iptables(state, netns)
    apply_nft(state, netns)


def test_hostile_manifests_never_reach_rule_text(tmp_path: Path) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump_all(hostile_documents(), allow_unicode=True))
    result = manifests.load(path)
    assert result.errors, "hostile objects must be reported"
    for err in result.errors:
        assert "\n" not in str(err) and "\r" not in str(err), "an error report is one line"
    names = {str(k[0]) for k in result.state.services}
    assert "shop/web:http" in names, "the good service is still used"

    texts = {
        "iptables": "".join(
            iptables_backend.render(result.state, f).restore_text() for f in IPFamily
        ),
        "nft": "".join(nft_backend.render(result.state, f).script() for f in IPFamily),
    }
    for backend, text in texts.items():
        assert not re.search("evil", text, re.IGNORECASE), f"{backend}: hostile text reached the rules"
        assert text.isascii() and "\x00" not in text and "\r" not in text, backend
    # And the nft transaction passes the in-memory kernel's checks (every reference exists);
    # the real kernel's acceptance is the kernel test above.
    for f in IPFamily:
        MemoryNft(f).apply(nft_backend.render(result.state, f).transactions())


@pytest.mark.parametrize("value", ['web"x', "web\nx", "web;x", "we{b}", "wéb", "web\\x"])
def test_renderers_refuse_or_quote_unvalidated_names(value: str) -> None:
    """Model values built without the source's validation are refused or safely quoted.

    nft puts names into chain names, so it refuses anything outside its name alphabet.
    iptables only puts them into double-quoted comments: there `;` and braces are inert and
    may stay (the kernel must then accept the text), while quotes, backslashes, line breaks
    and non-ASCII are refused.
    """
    from nfproxy.core.model import ClusterState, Endpoint

    svc = ServicePort(
        name=ServicePortName("shop", value, "http", Protocol.TCP),
        family=IPFamily.V4,
        type=ServiceType.CLUSTER_IP,
        cluster_ip="10.96.0.10",
        port=80,
    )
    state = ClusterState(services={svc.key: svc}, endpoints={svc.key: (Endpoint("10.244.0.5", 8080),)})
    with pytest.raises(ValueError):
        nft_backend.render(state, IPFamily.V4).script()
    if re.search(r'["\\\n]', value) or not value.isascii():
        with pytest.raises(ValueError):
            iptables_backend.render(state, IPFamily.V4).restore_text()
        return
    text = iptables_backend.render(state, IPFamily.V4).restore_text()
    for line in text.splitlines():
        if value in line:
            assert re.search(r'--comment "[^"]*' + re.escape(value) + r'[^"]*"', line), line


@pytest.mark.kernel
@pytest.mark.parametrize("value", ["web;x", "we{b}"])
def test_quoted_unvalidated_names_are_accepted_by_the_kernel(value: str, netns: str) -> None:
    """The names iptables keeps quoted (see above) must then be accepted by the kernel."""
    from nfproxy.core.model import ClusterState, Endpoint

    svc = ServicePort(
        name=ServicePortName("shop", value, "http", Protocol.TCP),
        family=IPFamily.V4,
        type=ServiceType.CLUSTER_IP,
        cluster_ip="10.96.0.10",
        port=80,
    )
    state = ClusterState(services={svc.key: svc}, endpoints={svc.key: (Endpoint("10.244.0.5", 8080),)})
    apply_iptables(state, netns)
