"""A model that spans nodes: a LeaderWorkerSet whose group is the leader pod and its workers, the RBAC the leader's
kubessh needs, the group's own network traffic and a disruption budget over the whole group.

Startup (kubernetes-sigs/lws pkg/controllers/pod_controller.go): with startupPolicy LeaderReady the workers are
created only once the leader is Ready, and our leader is Ready only when every rank runs, 8 of them inside a worker
pod: it would never start. With LeaderCreated the workers are created with the leader, and the leader's launcher
waits until every pod of its group (the group-key label) is Ready before mpirun, as the TensorRT-LLM example of
Triton's multi-node tutorial does in its server.py.
"""

from __future__ import annotations

from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.k8s_commands import GROUP_WAIT_SECONDS, LAUNCHER
from specdeploy.deploy.k8s_versions import Version
from specdeploy.deploy.sizing import PodSize
from specdeploy.package.package_stamp import STAMP_FILE

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# Not the Service's name: LWS creates its headless Service, named like the set, only where no Service of that name
# exists (kubernetes-sigs/lws@060ab4da pkg/controllers/leaderworkerset_controller.go), and the pods' DNS names need it
GROUP_NAME = f"{base.SERVER}-group"
HOLD_EXIT_MARGIN = 5  # seconds a worker's hold leaves itself to exit before the kubelet's SIGKILL
WORKER_PROBE_KEYS = ("startupProbe", "livenessProbe", "readinessProbe", "ports")
LAUNCHER_ACCOUNT = "mpi-launcher"  # the leader's alone: the build Job and the workers keep the base's, with no Role
MAX_SURGE = 1  # groups a rolling update adds beside the autoscaler's maximum


def worker_pod_names(set_name: str, nodes: int, groups: int = base.MAX_REPLICAS + MAX_SURGE) -> list[str]:
    """Every worker pod name the set can have: group i's leader pod is `<set>-<i>` and its workers, a StatefulSet
    named after the leader pod with ordinals from 1, are `<set>-<i>-<j>` (kubernetes-sigs/lws@060ab4da
    pkg/controllers/pod_controller.go); a rolling update adds groups at indices up to replicas + maxSurge - 1
    (leaderworkerset_controller.go). The autoscaler's maximum bounds the replicas."""
    return [f"{set_name}-{group}-{worker}" for group in range(groups) for worker in range(1, nodes)]


def launcher_role(set_name: str, nodes: int) -> list[dict]:
    """The leader's account, and a Role that lets it exec into its set's workers only. `list` on pods cannot be
    narrowed by name (the group wait lists by label); `get` and exec can. Exec needs `create`, and `get` where a
    WebSocket exec is authorized by its GET (Kubernetes before 1.35's AuthorizePodWebsocketUpgradeCreatePermission,
    kubernetes/website content/en/docs/reference/command-line-tools-reference/feature-gates)."""
    workers = worker_pod_names(set_name, nodes)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": LAUNCHER_ACCOUNT},
               "automountServiceAccountToken": False}
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": workers},
             {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"], "resourceNames": workers}]
    return [account, *base.bound_role("mpi", rules, LAUNCHER_ACCOUNT)]


def merged(document: dict, patch: dict) -> dict:
    """A strategic-merge-like merge for building the LeaderWorkerSet's pods from the base pod (lists of named
    items merge by name, other lists are replaced)."""
    result = dict(document)
    for key, value in patch.items():
        old = result.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            result[key] = merged(old, value)
        elif isinstance(old, list) and isinstance(value, list) and all(isinstance(v, dict) and "name" in v
                                                                        for v in old + value):
            by_name = {item["name"]: item for item in old}
            for item in value:
                by_name[item["name"]] = merged(by_name.get(item["name"], {}), item)
            result[key] = list(by_name.values())
        else:
            result[key] = value
    return result


def prefixed_references(pod: dict, prefix: str) -> dict:
    """kustomize renames the ConfigMap, claim and service account an overlay's Deployment names, but not inside a
    custom resource's pod templates: there the prefixed names are written here."""
    spec = dict(pod["spec"])
    spec["serviceAccountName"] = prefix + spec["serviceAccountName"]
    volumes = []
    for volume in spec["volumes"]:
        volume = dict(volume)
        if "configMap" in volume:
            volume["configMap"] = {**volume["configMap"], "name": prefix + volume["configMap"]["name"]}
        claim = volume.get("persistentVolumeClaim")
        if claim and claim["claimName"] == base.DATA_CLAIM:
            volume["persistentVolumeClaim"] = {**claim, "claimName": prefix + claim["claimName"]}
        volumes.append(volume)
    spec["volumes"] = volumes
    return {**pod, "spec": spec}


def leader_worker_set(pod_patch: dict, size: PodSize, image: str, prefix: str, labels: dict,
                      version: Version) -> list[dict]:
    """The LeaderWorkerSet (one group = size.nodes pods), the leader's RBAC for `kubectl exec` and the group's
    network policy. `labels`: the overlay's instance label, which kustomize does not add inside the templates."""
    leader_labels = {**base.SERVER_LABELS, **labels}  # the Service and PodMonitor select the leaders
    worker_labels = {**leader_labels, "app.kubernetes.io/component": "worker"}
    leader = prefixed_references(merged({"metadata": {"labels": leader_labels}, "spec": base.server_pod()},
                                        pod_patch), prefix)
    leader["spec"]["automountServiceAccountToken"] = True
    leader["spec"]["serviceAccountName"] = prefix + LAUNCHER_ACCOUNT
    leader["metadata"]["annotations"] = {**leader["metadata"].get("annotations", {}),
                                         "checkov.io/skip1": "CKV_K8S_38=kubessh: the leader's mpirun runs kubectl "
                                                             "exec into its workers"}
    # The leader waits for its group before loading the engines: its startup probe covers both
    loading = leader["spec"]["containers"][0]["startupProbe"]
    leader["spec"]["containers"][0]["startupProbe"] = {
        **loading, "failureThreshold": loading["failureThreshold"] + GROUP_WAIT_SECONDS // loading["periodSeconds"]}
    worker = merged(leader, {"metadata": {"labels": worker_labels}})
    # Workers host the ranks the leader starts in them: no endpoint, no API access, and a PID 1 that on SIGTERM
    # waits for those ranks to end (the leader drains the group through mpirun; launch.py hold), after the same
    # preStop pause as the leader's and within the same grace period
    grace = leader["spec"]["terminationGracePeriodSeconds"]
    # the ranks it hosts load the version's repository: the hold holds its lease (pods/versions.py)
    worker_container = {**worker["spec"]["containers"][0], "command": [*version.holding(wait=True), *LAUNCHER],
                        "args": ["hold", "--drain-timeout", str(grace - base.PRESTOP_SECONDS - HOLD_EXIT_MARGIN)]}
    worker_container.pop("env", None)
    worker_container["env"] = base.environment()
    for key in WORKER_PROBE_KEYS:
        worker_container.pop(key, None)
    # Ready once the packaged repository its ranks load is visible on its mount (the leader's wait counts it)
    worker_container["readinessProbe"] = {"exec": {"command": ["test", "-f", f"{version.repository}/{STAMP_FILE}"]},
                                          "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5}
    worker["metadata"]["annotations"] = {**worker["metadata"].get("annotations", {}),
                                         "checkov.io/skip1": "CKV_K8S_8=PID 1 is the hold process, the container "
                                                             "ends with it; the ranks it hosts are watched by the "
                                                             "leader's mpirun and liveness probe, and any pod's "
                                                             "restart recreates the group"}
    worker["spec"] = {**worker["spec"], "serviceAccountName": prefix + base.SERVICE_ACCOUNT,
                      "automountServiceAccountToken": False, "containers": [worker_container]}
    del worker["spec"]["initContainers"]
    for template in (leader, worker):
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            container["image"] = image
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": GROUP_NAME, "labels": base.SERVER_LABELS},
           "spec": {"startupPolicy": "LeaderCreated",  # no replicas: the HPA owns the count (default 1)
                    "rolloutStrategy": {"type": "RollingUpdate",
                                        "rollingUpdateConfiguration": {"maxUnavailable": 0,
                                                                       "maxSurge": MAX_SURGE}},
                    "leaderWorkerTemplate": {"size": size.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                                             "leaderTemplate": leader, "workerTemplate": worker}}}
    group = {LWS_NAME_LABEL: prefix + GROUP_NAME}
    # MPI and NCCL between a group's pods use ports of their own choosing
    group_traffic = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "group"},
                     "spec": {"podSelector": {"matchLabels": group}, "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": {"matchLabels": group}}]}]}}
    return [lws, *launcher_role(prefix + GROUP_NAME, size.nodes), group_traffic]


def group_disruption_budget(prefix: str) -> dict:
    """A patch of the base PDB: over every pod of the set, leaders and workers. Losing any pod recreates its whole
    group, so at most one pod at a time means at most one group down at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": base.SERVER},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {LWS_NAME_LABEL: prefix + GROUP_NAME}}}}
