"""Thin Kubernetes access for the operator: server-side apply, pruning, a few reads.

Server-side apply (one PATCH per child, ``force`` under our field manager) makes
reconciling idempotent and level-based: applying the same desired state twice
changes nothing, and a child edited or deleted by hand is put back.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from kubernetes_asyncio import client, config

FIELD_MANAGER = "llmserve-operator"


@dataclass(frozen=True)
class ChildKind:
    """How to reach one kind of child: the typed API class, the suffix of its
    ``*_namespaced_<suffix>`` methods, and its RBAC group and resource (the chart's
    ClusterRole grants ``delete`` on exactly these, a test checks)."""
    api: type
    suffix: str
    group: str
    resource: str


# Every kind the builders render; each is also listed and pruned.
CHILD_KINDS = {
    "Deployment": ChildKind(client.AppsV1Api, "deployment", "apps", "deployments"),
    "Service": ChildKind(client.CoreV1Api, "service", "", "services"),
    "ServiceAccount": ChildKind(client.CoreV1Api, "service_account", "", "serviceaccounts"),
    "Role": ChildKind(client.RbacAuthorizationV1Api, "role", "rbac.authorization.k8s.io",
                      "roles"),
    "RoleBinding": ChildKind(client.RbacAuthorizationV1Api, "role_binding",
                             "rbac.authorization.k8s.io", "rolebindings"),
    "NetworkPolicy": ChildKind(client.NetworkingV1Api, "network_policy", "networking.k8s.io",
                               "networkpolicies"),
}
# Children created once and read back by name to prune, never listed: the operator may
# not list Secrets (a list returns every Secret's data in the namespace).
NAMED_CHILD_KINDS = {
    "Secret": ChildKind(client.CoreV1Api, "secret", "", "secrets"),
}


def _method(api: client.ApiClient, kind: str, verb: str):
    k = CHILD_KINDS.get(kind) or NAMED_CHILD_KINDS[kind]
    return getattr(k.api(api), f"{verb}_namespaced_{k.suffix}")


async def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()


async def apply(api: client.ApiClient, manifest: dict) -> None:
    """Server-side apply ``manifest`` (create it, or take back the fields we own)."""
    m = manifest["metadata"]
    await _method(api, manifest["kind"], "patch")(
        m["name"], m["namespace"], manifest, field_manager=FIELD_MANAGER, force=True,
        _content_type="application/apply-patch+yaml")


async def create_if_absent(api: client.ApiClient, manifest: dict) -> tuple[dict, bool]:
    """Create ``manifest`` unless an object of its name exists (then it is left exactly
    as it is): (the live object with its ``kind``, whether this call created it)."""
    kind, m = manifest["kind"], manifest["metadata"]
    try:
        obj = await _method(api, kind, "create")(m["namespace"], manifest)
    except client.exceptions.ApiException as e:
        if e.status != 409:
            raise
        existing = await read_named(api, m["namespace"], kind, m["name"])
        if existing is None:  # deleted since: the next pass creates it
            raise
        return existing, False
    return {**api.sanitize_for_serialization(obj), "kind": kind}, True


async def read_named(api: client.ApiClient, namespace: str, kind: str, name: str
                     ) -> dict | None:
    """One object as a plain dict with its ``kind``; None if it does not exist."""
    obj = await read_or_none(_method(api, kind, "read"), name, namespace)
    return None if obj is None else {**api.sanitize_for_serialization(obj), "kind": kind}


async def list_children(api: client.ApiClient, namespace: str, label_selector: str
                        ) -> list[dict]:
    """Every object of the child kinds in ``namespace`` that matches the selector, as
    plain dicts with their ``kind`` (list responses leave it out of the items)."""
    out = []
    for kind in CHILD_KINDS:
        listed = await _method(api, kind, "list")(namespace, label_selector=label_selector)
        for item in listed.items:
            out.append({**api.sanitize_for_serialization(item), "kind": kind})
    return out


async def delete(api: client.ApiClient, obj: dict) -> None:
    """Delete one live child, only if it is still the object that was listed: the uid
    precondition keeps a same-named object created since (not ours) from going. Gone
    already, or replaced (409), is left as is."""
    m = obj["metadata"]
    options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=m["uid"]),
                                      propagation_policy="Background")
    try:
        await _method(api, obj["kind"], "delete")(m["name"], m["namespace"], body=options)
    except client.exceptions.ApiException as e:
        if e.status not in (404, 409):
            raise


async def read_or_none(read, *args):
    """``await read(*args)``, or None where the object does not exist (404)."""
    try:
        return await read(*args)
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        raise


async def get_deployment(api: client.ApiClient, namespace: str, name: str) -> dict | None:
    dep = await read_or_none(client.AppsV1Api(api).read_namespaced_deployment, name, namespace)
    return None if dep is None else api.sanitize_for_serialization(dep)


async def read_secret_value(api: client.ApiClient, namespace: str, name: str, key: str
                            ) -> bytes | None:
    """One key of a Secret, decoded; None if the Secret or the key does not exist."""
    secret = await read_or_none(client.CoreV1Api(api).read_namespaced_secret, name, namespace)
    value = None if secret is None else (secret.data or {}).get(key)
    return None if value is None else base64.b64decode(value)


async def ready_pod_ips(api: client.ApiClient, namespace: str, label_selector: str) -> list[str]:
    return [p.ip for p in await ready_pods(api, namespace, label_selector)]


@dataclass(frozen=True)
class ReadyPod:
    uid: str
    name: str
    ip: str
    args: tuple[str, ...]  # its first container's, to tell which template it runs


async def ready_pods(api: client.ApiClient, namespace: str, label_selector: str
                     ) -> list[ReadyPod]:
    """The pods that are Ready, have an IP and are not being deleted."""
    core = client.CoreV1Api(api)
    pods = await core.list_namespaced_pod(namespace, label_selector=label_selector)
    out = []
    for pod in pods.items:
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (pod.status.conditions or []))
        if ready and pod.status.pod_ip and pod.metadata.deletion_timestamp is None:
            containers = pod.spec.containers or []
            args = tuple(containers[0].args or []) if containers else ()
            out.append(ReadyPod(pod.metadata.uid, pod.metadata.name, pod.status.pod_ip, args))
    return out
