"""Thin Kubernetes access for the operator: server-side apply and a few reads.

Server-side apply (one PATCH per child, ``force`` under our field manager) makes
reconciling idempotent and level-based: applying the same desired state twice
changes nothing, and a child edited or deleted by hand is put back.
"""

from __future__ import annotations

from kubernetes_asyncio import client, config

FIELD_MANAGER = "llmserve-operator"

# kind -> (typed API class, patch method)
_PATCHERS = {
    "Deployment": (client.AppsV1Api, "patch_namespaced_deployment"),
    "Service": (client.CoreV1Api, "patch_namespaced_service"),
    "ServiceAccount": (client.CoreV1Api, "patch_namespaced_service_account"),
    "Role": (client.RbacAuthorizationV1Api, "patch_namespaced_role"),
    "RoleBinding": (client.RbacAuthorizationV1Api, "patch_namespaced_role_binding"),
    "NetworkPolicy": (client.NetworkingV1Api, "patch_namespaced_network_policy"),
}


async def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()


async def apply(api: client.ApiClient, manifest: dict) -> None:
    """Server-side apply ``manifest`` (create it, or take back the fields we own)."""
    api_class, method = _PATCHERS[manifest["kind"]]
    m = manifest["metadata"]
    await getattr(api_class(api), method)(
        m["name"], m["namespace"], manifest, field_manager=FIELD_MANAGER, force=True,
        _content_type="application/apply-patch+yaml")


async def get_deployment(api: client.ApiClient, namespace: str, name: str) -> dict | None:
    apps = client.AppsV1Api(api)
    try:
        dep = await apps.read_namespaced_deployment(name, namespace)
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        raise
    return api.sanitize_for_serialization(dep)


async def read_secret_value(api: client.ApiClient, namespace: str, name: str, key: str
                            ) -> bytes | None:
    """One key of a Secret, decoded; None if the Secret or the key does not exist."""
    import base64
    try:
        secret = await client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        raise
    value = (secret.data or {}).get(key)
    return None if value is None else base64.b64decode(value)


async def ready_pod_ips(api: client.ApiClient, namespace: str, label_selector: str) -> list[str]:
    core = client.CoreV1Api(api)
    pods = await core.list_namespaced_pod(namespace, label_selector=label_selector)
    ips = []
    for pod in pods.items:
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (pod.status.conditions or []))
        if ready and pod.status.pod_ip and pod.metadata.deletion_timestamp is None:
            ips.append(pod.status.pod_ip)
    return ips


async def scale_deployment(api: client.ApiClient, namespace: str, name: str,
                           replicas: int) -> None:
    apps = client.AppsV1Api(api)
    await apps.patch_namespaced_deployment_scale(name, namespace,
                                                 {"spec": {"replicas": replicas}})
