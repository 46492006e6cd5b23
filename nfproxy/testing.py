"""Random but valid clusters, for property tests and kernel acceptance tests.

Built straight as model values (not manifests) so that renderer properties are tested on every
combination the model allows, independent of the manifest parser.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)

NODE = NodeConfig(
    name="node-a",
    ips=("192.168.0.2", "fd00:1::2"),
    cluster_cidrs=("10.0.0.0/8", "fd01::/48"),
    zone="zone-a",
)

PORT_NAMES = ["http", "p80", "dns", "grpc-web", "metrics"]


def _ip(family: IPFamily, kind: int, i: int, j: int = 0) -> str:
    """Unique addresses per (kind, i, j): kind 1 cluster IPs, 2 endpoints, 3 external, 4 LB."""
    if family is IPFamily.V4:
        base = {1: 172, 2: 10, 3: 203, 4: 198}[kind]
        return f"{base}.{(i >> 8) & 255}.{i & 255}.{j + 1}"
    return f"fd0{kind}::{i:x}:{j + 1:x}"


def _endpoint(rng: random.Random, family: IPFamily, i: int, j: int, port: int) -> Endpoint:
    ready = rng.random() < 0.8
    terminating = not ready and rng.random() < 0.6
    serving = ready or (terminating and rng.random() < 0.7)
    hinted = rng.random() < 0.2
    return Endpoint(
        ip=_ip(family, 2, i, j),
        port=port,
        ready=ready,
        serving=serving,
        terminating=terminating,
        node_name=rng.choice(["node-a", "node-b", "node-c", ""]),
        zone_hints=frozenset({rng.choice(["zone-a", "zone-b"])}) if hinted else frozenset(),
    )


def random_cluster(
    rng: random.Random, services: int, max_endpoints: int = 12, node: NodeConfig = NODE
) -> ClusterState:
    """`services` services (one or two ports each) with 0..max_endpoints endpoints per port."""
    svc_map: dict = {}
    ep_map: dict = {}
    next_node_port = 30000
    for i in range(services):
        family = rng.choice([IPFamily.V4, IPFamily.V4, IPFamily.V6])
        stype = rng.choice(list(ServiceType))
        nports = rng.choice([1, 1, 2])
        names = [""] if nports == 1 and rng.random() < 0.5 else rng.sample(PORT_NAMES, nports)
        affinity = rng.choice([0, 0, 0, 10800, 60])
        etp_local = stype is not ServiceType.CLUSTER_IP and rng.random() < 0.3
        itp_local = rng.random() < 0.1
        external_ips = (_ip(family, 3, i),) if rng.random() < 0.15 else ()
        lb_ips: tuple[str, ...] = ()
        ranges: tuple[str, ...] = ()
        if stype is ServiceType.LOAD_BALANCER:
            lb_ips = (_ip(family, 4, i),)
            if rng.random() < 0.5:
                ranges = ("203.0.113.0/24", "192.168.0.0/16") if family is IPFamily.V4 else (
                    "2001:db8::/32",
                )
        n_eps = rng.randint(0, max_endpoints)
        for p, pname in enumerate(names):
            proto = rng.choice([Protocol.TCP, Protocol.TCP, Protocol.UDP, Protocol.SCTP])
            spn = ServicePortName(f"ns-{i % 7}", f"svc-{i}", pname, proto)
            node_port = 0
            if stype is not ServiceType.CLUSTER_IP:
                node_port = next_node_port
                next_node_port += 1
            svc = ServicePort(
                name=spn,
                family=family,
                type=stype,
                cluster_ip=_ip(family, 1, i),
                port=80 + p,
                node_port=node_port,
                external_ips=external_ips,
                load_balancer_ips=lb_ips,
                load_balancer_source_ranges=ranges,
                affinity_timeout=affinity,
                external_policy_local=etp_local,
                internal_policy_local=itp_local,
                health_check_node_port=(32000 + i) if etp_local and lb_ips else 0,
            )
            svc_map[svc.key] = svc
            eps = [_endpoint(rng, family, i, j, 8080 + p) for j in range(n_eps)]
            if eps:
                ep_map[svc.key] = sort_endpoints(eps)
    return ClusterState(node=node, services=svc_map, endpoints=ep_map)


def uniform_cluster(services: int, endpoints: int, node: NodeConfig = NODE) -> ClusterState:
    """IPv4 TCP ClusterIP services, all endpoints ready and remote: the scale benchmark shape."""
    svc_map: dict = {}
    ep_map: dict = {}
    for i in range(services):
        spn = ServicePortName(f"ns-{i % 100}", f"svc-{i}", "http", Protocol.TCP)
        svc = ServicePort(
            name=spn,
            family=IPFamily.V4,
            type=ServiceType.CLUSTER_IP,
            cluster_ip=f"172.30.{i >> 8 & 255}.{i & 255}" if i < 65536 else f"172.31.{i >> 8 & 255}.{i & 255}",
            port=80,
        )
        svc_map[svc.key] = svc
        ep_map[svc.key] = sort_endpoints(
            [
                Endpoint(ip=f"10.{(i >> 8) & 255}.{i & 255}.{j + 1}", port=8080, node_name="node-b")
                for j in range(endpoints)
            ]
        )
    return ClusterState(node=node, services=svc_map, endpoints=ep_map)


def clusters(max_services: int = 25, max_endpoints: int = 12) -> st.SearchStrategy[ClusterState]:
    return st.builds(
        random_cluster,
        st.randoms(use_true_random=False),
        st.integers(1, max_services),
        st.just(max_endpoints),
    )


def manifest_objects(state: ClusterState) -> list[dict]:
    """`state`'s services as Service and EndpointSlice objects (camelCase, as `kubectl get -o
    json`), so the manifest loader and the daemon can be fed a generated cluster.

    One slice per service port and family, named after the port; node settings are not written
    (give them as flags)."""
    by_service: dict[tuple[str, str], list[ServicePort]] = {}
    for sp in state.services.values():
        by_service.setdefault((sp.name.namespace, sp.name.name), []).append(sp)
    objects: list[dict] = []
    for (namespace, name), ports in sorted(by_service.items()):
        objects.append(_service_object(namespace, name, ports))
        for sp in ports:
            if sp.key in state.endpoints:
                objects.append(_slice_object(sp, state.endpoints[sp.key]))
    return objects


def _service_object(namespace: str, name: str, ports: list[ServicePort]) -> dict:
    first = ports[0]
    ips = sorted({(sp.family, sp.cluster_ip) for sp in ports})
    unique = {(sp.name.port, sp.name.protocol): sp for sp in ports}
    spec: dict = {
        "type": first.type.value,
        "clusterIP": ips[0][1],
        "clusterIPs": [ip for _, ip in ips],
        "ipFamilies": [f"IPv{family.value}" for family, _ in ips],
        "ports": [
            {"name": sp.name.port, "protocol": sp.name.protocol.value, "port": sp.port,
             **({"nodePort": sp.node_port} if sp.node_port else {})}
            for sp in unique.values()
        ],
    }
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": namespace, "name": name}, "spec": spec}


def _slice_object(sp: ServicePort, endpoints: tuple[Endpoint, ...]) -> dict:
    port = endpoints[0].port if endpoints else sp.port
    suffix = f"{sp.name.port or 'port'}-{sp.name.protocol.lower}-v{sp.family.value}"
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": sp.name.namespace,
            "name": f"{sp.name.name}-{suffix}",
            "labels": {"kubernetes.io/service-name": sp.name.name},
        },
        "addressType": f"IPv{sp.family.value}",
        "ports": [{"name": sp.name.port, "protocol": sp.name.protocol.value, "port": port}],
        "endpoints": [_endpoint_object(e) for e in endpoints],
    }


def _endpoint_object(e: Endpoint) -> dict:
    obj: dict = {
        "addresses": [e.ip],
        "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
    }
    if e.node_name:
        obj["nodeName"] = e.node_name
    if e.zone:
        obj["zone"] = e.zone
    hints = {}
    if e.zone_hints:
        hints["forZones"] = [{"name": z} for z in sorted(e.zone_hints)]
    if e.node_hints:
        hints["forNodes"] = [{"name": n} for n in sorted(e.node_hints)]
    if hints:
        obj["hints"] = hints
    return obj
