"""Endpoint discovery: a static list, or the EndpointSlices of a Kubernetes Service.

The Kubernetes path lists the Service's EndpointSlices and then watches them, so
pods that become ready join routing and pods that go away leave it without a
restart. ``urls_from_slices`` is the pure part (unit tested); the watch loop
only feeds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"


def urls_from_slices(slices: Iterable[dict], port_name: str | None = None) -> list[str]:
    """Ready endpoint addresses of EndpointSlices (as JSON dicts) -> base URLs."""
    urls = set()
    for s in slices:
        ports = s.get("ports") or []
        port = next((p for p in ports if port_name is None or p.get("name") == port_name), None)
        if port is None or port.get("port") is None:
            continue
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if ":" in addr else addr
                urls.add(f"http://{host}:{port['port']}")
    return sorted(urls)


async def watch_endpoint_slices(namespace: str, service: str, on_change: Callable[[list], None],
                                port_name: str | None = None, kubeconfig: str | None = None
                                ) -> None:
    """List and watch the Service's EndpointSlices forever, calling ``on_change``
    with the current URLs after every change. Reconnects on errors."""
    from kubernetes_asyncio import client, config, watch
    from kubernetes_asyncio.client.exceptions import ApiException
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config(config_file=kubeconfig)
    selector = f"{SERVICE_LABEL}={service}"
    async with client.ApiClient() as api_client:
        api = client.DiscoveryV1Api(api_client)
        while True:
            try:
                listing = await api.list_namespaced_endpoint_slice(namespace,
                                                                   label_selector=selector)
                slices = {s.metadata.name: api_client.sanitize_for_serialization(s)
                          for s in listing.items}
                on_change(urls_from_slices(slices.values(), port_name))
                w = watch.Watch()
                async for event in w.stream(api.list_namespaced_endpoint_slice, namespace,
                                            label_selector=selector,
                                            resource_version=listing.metadata.resource_version,
                                            timeout_seconds=300):
                    obj = api_client.sanitize_for_serialization(event["object"])
                    name = obj["metadata"]["name"]
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    on_change(urls_from_slices(slices.values(), port_name))
            except asyncio.CancelledError:
                raise
            except (ApiException, OSError, ValueError) as e:  # 410 Gone, network blips
                log.warning("EndpointSlice watch of %s/%s: %s; relisting", namespace, service, e)
                await asyncio.sleep(1.0)
