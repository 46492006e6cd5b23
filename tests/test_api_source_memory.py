"""The API source keeps objects as parsed, not as JSON (docs/design.md, "The API source's
memory"): a slice's endpoints in the state are the very objects its record holds, so the
cache adds only a few small objects per Service and EndpointSlice to what the state costs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nfproxy.core.model import NodeConfig
from nfproxy.sources import kube
from nfproxy.sources.kube import ENDPOINT_SLICES, SERVICES, ObjectCache
from tests.apiserver import endpoint_slice, service

MANAGED = [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:endpoints": {}, "f:ports": {}}}]


def _as_the_server_sends(obj: dict) -> dict:
    """What a real API server adds that no rule reads."""
    obj = copy.deepcopy(obj)
    obj["metadata"].update(uid="5f0c3d5e-0000-4000-8000-000000000001", resourceVersion="7",
                           creationTimestamp="2026-12-07T05:00:00Z", managedFields=MANAGED)
    for i, endpoint in enumerate(obj.get("endpoints", ())):
        endpoint["targetRef"] = {"kind": "Pod", "namespace": "default", "name": f"web-{i}",
                                 "uid": f"5f0c3d5e-0000-4000-8000-{i:012d}"}
    return obj


def test_the_state_shares_the_records_endpoints() -> None:
    cache = ObjectCache(NodeConfig(name="node-a"))
    cache.replace(SERVICES, [_as_the_server_sends(service(f"web{i}", f"10.96.0.{i + 1}")) for i in range(3)])
    cache.replace(ENDPOINT_SLICES, [
        _as_the_server_sends(endpoint_slice(f"web{i}-1", f"web{i}", [f"10.244.{i}.1", f"10.244.{i}.2"]))
        for i in range(3)
    ])
    state = cache.snapshot().state
    assert len(state.endpoints) == 3
    held = {
        id(endpoint)
        for record in cache._objects.values()
        for entry in record.entries
        if getattr(entry, "kind", None) == "EndpointSlice"
        for per_port in entry.value.endpoints
        for endpoint in per_port
    }
    in_state = [e for endpoints in state.endpoints.values() for e in endpoints]
    assert len(in_state) == 6 and all(id(e) in held for e in in_state)
    assert all(type(record) is kube._Record for record in cache._objects.values())


# --------------------------------------------------------------------------------------------
# A list response read one item at a time


def _rebuilt(text: str) -> dict:
    out: dict = {}
    for key, value in kube._members(text):
        if key == kube._ITEM:
            out.setdefault("items", []).append(value)
        else:
            out[key] = value
    return out


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(st.sampled_from(["kind", "apiVersion", "metadata", "x"]), JSON, max_size=4),
    items=st.none() | st.lists(JSON, max_size=4),
    indent=st.sampled_from([None, 0, 2]),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]),
)
def test_members_read_what_json_reads(body, items, indent, separators) -> None:
    doc = dict(body)
    if items is not None:
        doc["items"] = items
    text = "\n " + json.dumps(doc, indent=indent, separators=separators) + " \r\n"
    expected = {k: v for k, v in json.loads(text).items() if not (k == "items" and v == [])}
    assert _rebuilt(text) == expected


@pytest.mark.parametrize("text", [
    "", "{", '{"a":1,}', '{"a":1}x', '{"items":[1,]}', '{"items":[1 2]}', "{1:2}",
    '{"a" 1}', '{"items":[1]', '{"a":1}{"b":2}',
])
def test_members_refuse_what_json_refuses(text) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        _rebuilt(text)


@pytest.mark.parametrize("text", ["[]", '"items"', "null", "[{}]"])
def test_members_refuse_what_is_no_object(text) -> None:
    with pytest.raises(ValueError):
        _rebuilt(text)


def test_each_item_is_parsed_before_the_next_is_decoded() -> None:
    """The point of `_members`: the consumer is handed item k before item k+1 exists."""
    text = json.dumps({"metadata": {"resourceVersion": "1"}, "items": [{"n": i} for i in range(3)]})
    seen = []
    walk = kube._members(text)
    for key, value in walk:
        if key == kube._ITEM:
            seen.append(value["n"])
            break
    assert seen == [0]
    assert [v["n"] for k, v in walk if k == kube._ITEM] == [1, 2]


def test_the_source_loads_no_generated_api_class() -> None:
    """The generated CoreV1Api, DiscoveryV1Api and NetworkingV1Api import ~260 pydantic model
    modules (~23 MiB) for their signatures; the source makes the same requests through
    ApiClient's own methods. Checked in a fresh interpreter: this one may have loaded them."""
    code = (
        "import sys\n"
        "from nfproxy.core.model import NodeConfig\n"
        "from nfproxy.sources.kube import KubeSource, api_client\n"
        "KubeSource(api_client(master='http://127.0.0.1:9'), NodeConfig(name='n'))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('kubernetes.client.api.', "
        "'kubernetes.client.models.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    loaded = eval(done.stdout)  # noqa: S307 - our own child's repr of a list of names
    assert not [m for m in loaded if m.startswith("kubernetes.client.api.")], loaded
    assert len(loaded) <= 3, loaded


class _Response:
    """What `_Lister` hands back: the raw body, and a connection to give back."""

    def __init__(self, body: bytes) -> None:
        self.data = body
        self.released = False

    def release_conn(self) -> None:
        self.released = True


def test_a_list_is_read_from_raw_bytes_as_json_loads_reads_them() -> None:
    """A byte-order mark is no error (json.loads takes one), and the page's metadata may come
    after its items."""
    items = [service(f"web{i}", f"10.96.0.{i + 1}") for i in range(2)]
    for item in items:
        del item["kind"], item["apiVersion"]  # list items carry neither
    body = {"kind": "ServiceList", "apiVersion": "v1", "items": items, "metadata": {"resourceVersion": "42"}}
    response = _Response(b"\xef\xbb\xbf" + json.dumps(body, indent=1).encode())
    cache = ObjectCache(NodeConfig(name="node-a"))
    reflector = kube._Reflector(SERVICES, lambda **_: response, cache, kube.WatchSettings(),
                                lambda: None, threading.Event())
    assert reflector._list() == "42"
    assert response.released
    assert cache.counts()["Service"] == 2
    assert len(cache.snapshot().state.services) == 2
