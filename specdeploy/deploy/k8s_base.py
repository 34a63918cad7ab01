"""The kustomize base every overlay builds on: the objects and settings that do not depend on the pipeline.

The base alone is the CPU shape (torch backend, no GPUs); an overlay (deploy/k8s.py) names the pipeline, the image,
the commands, the resources and, for GPUs, the devices. Object names are fixed here and patched by name there.
Paths inside the containers: the data volume (PVC) at DATA_DIR holds engines/ and models/ (hard links between them
need one file system), the pipeline ConfigMap is mounted at PIPELINE_DIR.
"""

from __future__ import annotations

from specdeploy.package.package_stamp import STAMP_FILE
from specdeploy.pods.job_status import SERVICE_ACCOUNT_DIR

APP = "specdeploy"
# Object names; each overlay prefixes them with its pipeline's name, so several pipelines share a namespace
SERVER = "triton"  # Deployment (or LeaderWorkerSet), Service, PDB, HPA, PodMonitor, NetworkPolicy
BUILD_JOB = "engine-build"
API_TOKEN_VOLUME = "api-token"  # the wait's credentials for reading the build Job's status
DATA_CLAIM = "data"
PIPELINE_CONFIGMAP = "pipeline"
SERVICE_ACCOUNT = "server"
IMAGE = "specdeploy"  # the name overlays replace through kustomize's `images`
DATA_DIR = "/var/lib/specdeploy"
ENGINES_DIR = f"{DATA_DIR}/engines"
MODELS_DIR = f"{DATA_DIR}/models"
PIPELINE_DIR = "/etc/specdeploy"
PIPELINE_KEY = "pipeline.yaml"
UID = 10001  # the images' user (build/Dockerfile.*)
TRITON_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
OPENAI_PORT = 9000  # the OpenAI-compatible endpoints (serve/openai_api/): `specdeploy serve`'s, or a sidecar's
PORTS = {**TRITON_PORTS, "openai": OPENAI_PORT}  # what the Service and the NetworkPolicy open
# gRPC is HTTP/2 in clear text: Gateway and Ingress implementations proxy it as such only when told (review N10)
APP_PROTOCOLS = {"grpc": "kubernetes.io/h2c"}
SERVER_LABELS = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "server"}
BUILD_LABELS = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "engine-build"}
PRESTOP_SECONDS = 10  # endpoints stop routing to a terminating pod before the server starts draining
BUILD_DEADLINE_S = 3600  # the base build Job's activeDeadlineSeconds (overlays set their own)
WAIT_MARGIN_S = 300  # the serving pods' wait outlasts the Job's deadline by this much
BUILD_BACKOFF_LIMIT = 2  # retries of a failed build pod; the serving pods' wait gives up after as many failures + 1
MAX_REPLICAS = 4  # the autoscaler's (overlays lower it where one node must hold every pod)
BUILD_TTL_SECONDS = 7 * 24 * 3600  # a finished build Job (and its logs) is kept a week, then removed
QUEUE_COMPUTE_METRIC = "triton:queue_compute:ratio"
WAITING_METRIC = "specdeploy_waiting_requests"


def pod_security() -> dict:
    """Non-root, with the data volume's group. fsGroupChangePolicy OnRootMismatch: the kubelet changes ownership
    only where the volume's root is not already the group's, instead of walking every engine file at each pod
    start (kubernetes@7dd8853 pkg/volume/volume_linux.go)."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "privileged": False,
            "runAsNonRoot": True, "runAsUser": UID, "capabilities": {"drop": ["ALL"]}}


def environment() -> list[dict]:
    """What every specdeploy container sees: no model hub, engines on the volume, a writable home."""
    return [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "SPECDEPLOY_ENGINES", "value": ENGINES_DIR},
            {"name": "HOME", "value": "/tmp"}]


def journal_environment(repository: str = MODELS_DIR) -> list[dict]:
    """Where the build journal lives (beside the repository, on the data volume) and what it is keyed by; overlays
    set the repository's path."""
    return [{"name": "REPOSITORY", "value": repository}, {"name": "JOURNAL", "value": f"{repository}.build-journal"},
            {"name": "PIPELINE", "value": f"{PIPELINE_DIR}/{PIPELINE_KEY}"}]


def wait_environment(repository: str, build_deadline_s: int, job: str = BUILD_JOB) -> list[dict]:
    """The wait's: the journal's, the build Job's name (whose status it reads) and how long it waits at most (the
    Job's activeDeadlineSeconds and WAIT_MARGIN_S, after which the Job has ended whatever the journal says)."""
    return [*journal_environment(repository), {"name": "BUILD_JOB", "value": job},
            {"name": "GIVE_UP_AFTER", "value": str(build_deadline_s + WAIT_MARGIN_S)}]


def api_token_volume() -> dict:
    """The service account's credentials as the kubelet would mount them (a token it rotates, the cluster's CA and
    the namespace), for the one container that mounts this volume: the pod itself mounts no token."""
    return {"name": API_TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


def mounts(pipeline: bool = True) -> list[dict]:
    volumes = [{"name": "data", "mountPath": DATA_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if pipeline:
        volumes.append({"name": "pipeline", "mountPath": PIPELINE_DIR, "readOnly": True})
    return volumes


def volumes() -> list[dict]:
    return [{"name": "data", "persistentVolumeClaim": {"claimName": DATA_CLAIM}},
            {"name": "pipeline", "configMap": {"name": PIPELINE_CONFIGMAP}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]


def bound_role(name: str, rules: list[dict], account: str) -> list[dict]:
    """A Role named `name` with `rules`, and the RoleBinding that grants it to the service account `account`."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name},
            "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": account}]}
    return [role, binding]


def service_account() -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVICE_ACCOUNT},
            "automountServiceAccountToken": False}


def data_claim() -> dict:
    """Engines and model repositories. Overlays set the access mode, the storage class and the size."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": DATA_CLAIM},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}


def journal_command(*arguments: str) -> list[str]:
    return ["python3", "-m", "specdeploy.pods.build_journal", *arguments, "--journal", "$(JOURNAL)",
            "--pipeline", "$(PIPELINE)"]


def step_command(name: str) -> list[str]:
    """A build Job step's command up to its arguments: `specdeploy` under the build journal's record."""
    return [*journal_command("record"), "--job-uid", "$(JOB_UID)", "--step", name, "--", "specdeploy"]


def build_job() -> dict:
    """`specdeploy build` (an init container) then `specdeploy package`: both skip when their inputs are unchanged,
    so rerunning the Job, or applying it again, does nothing. Each step runs under the build journal (its start and
    failures, for the serving pods' wait). A configuration error (exit status 2) fails the Job at once; an evicted or
    preempted pod does not count against backoffLimit. Overlays set the arguments, resources and deadline."""
    def step(name: str) -> dict:
        return {"name": name, "image": IMAGE, "imagePullPolicy": "IfNotPresent", "command": step_command(name),
                "args": [name], "env": [*environment(), *journal_environment(),
                                        {"name": "JOB_UID", "valueFrom": {"fieldRef": {
                                            "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}}],
                "volumeMounts": mounts(), "securityContext": container_security(),
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}}

    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": BUILD_JOB, "labels": BUILD_LABELS},
            "spec": {"backoffLimit": BUILD_BACKOFF_LIMIT, "ttlSecondsAfterFinished": BUILD_TTL_SECONDS,
                     "activeDeadlineSeconds": BUILD_DEADLINE_S,
                     "podFailurePolicy": {"rules": [
                         {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}},
                         {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                     "template": {
                         "metadata": {"labels": BUILD_LABELS},
                         "spec": {"restartPolicy": "Never", "serviceAccountName": SERVICE_ACCOUNT,
                                  "automountServiceAccountToken": False, "securityContext": pod_security(),
                                  "initContainers": [step("build")], "containers": [step("package")],
                                  "volumes": volumes()}}}}


def probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def server_container() -> dict:
    """The serving container: Triton's ports, its health endpoints as probes (the startup probe covers loading),
    /dev/shm for the Python backend's stubs, the preStop pause before the drain."""
    return {"name": "triton", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
            "command": ["specdeploy"], "args": ["serve"], "env": environment(),
            "ports": [{"name": name, "containerPort": port, "protocol": "TCP"}
                      for name, port in TRITON_PORTS.items()],
            "startupProbe": probe("/v2/health/ready", 10, 60),
            "livenessProbe": probe("/v2/health/live", 10, 3),
            "readinessProbe": probe("/v2/health/ready", 5, 3),
            "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
            "volumeMounts": [*mounts(pipeline=False), {"name": "dshm", "mountPath": "/dev/shm"}],
            "securityContext": container_security(),
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}}


def wait_container(repository: str = MODELS_DIR) -> dict:
    """Holds the server back until the build Job has packaged the repository from this pipeline: the package stamp
    (written last) records the pipeline file's SHA-256, which a pod of an older pipeline's repository lacks. Gives up,
    naming the failure, when the Job's status or the build journal shows that it has failed for good. It alone
    mounts the service account's token, which may read that Job only (the overlay's build-status Role)."""
    return {"name": "wait-for-repository", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
            "command": [*journal_command("wait"), "--stamp", f"$(REPOSITORY)/{STAMP_FILE}",
                        "--backoff-limit", str(BUILD_BACKOFF_LIMIT), "--give-up-after", "$(GIVE_UP_AFTER)",
                        "--job", "$(BUILD_JOB)"],
            "env": wait_environment(repository, BUILD_DEADLINE_S),
            "volumeMounts": [*mounts(), {"name": API_TOKEN_VOLUME, "mountPath": str(SERVICE_ACCOUNT_DIR),
                                         "readOnly": True}],
            "securityContext": container_security(),
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}}


def server_pod(grace_seconds: int = 60) -> dict:
    return {"serviceAccountName": SERVICE_ACCOUNT, "automountServiceAccountToken": False,
            "securityContext": pod_security(), "terminationGracePeriodSeconds": grace_seconds,
            "initContainers": [wait_container()], "containers": [server_container()],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": DATA_CLAIM, "readOnly": True}},
                        {"name": "pipeline", "configMap": {"name": PIPELINE_CONFIGMAP}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                        api_token_volume()]}


def deployment() -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": SERVER, "labels": SERVER_LABELS},
            "spec": {"selector": {"matchLabels": SERVER_LABELS},  # no replicas: the HPA owns the count (default 1)
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": SERVER_LABELS}, "spec": server_pod()}}}


def service() -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVER, "labels": SERVER_LABELS},
            "spec": {"type": "ClusterIP", "selector": SERVER_LABELS,
                     "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP",
                                **({"appProtocol": APP_PROTOCOLS[name]} if name in APP_PROTOCOLS else {})}
                               for name, port in PORTS.items()]}}


def disruption_budget() -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": SERVER},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": SERVER_LABELS}}}


def network_policy() -> dict:
    """Only the served ports (Triton's and the OpenAI endpoints'), and only from inside the cluster (clients,
    Prometheus)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": SERVER},
            "spec": {"podSelector": {"matchLabels": SERVER_LABELS}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"namespaceSelector": {}}],
                                  "ports": [{"protocol": "TCP", "port": name} for name in PORTS]}]}}


def build_network_policy() -> dict:
    """The build Job's pods serve nothing: no ingress at all."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": BUILD_JOB},
            "spec": {"podSelector": {"matchLabels": BUILD_LABELS}, "policyTypes": ["Ingress"]}}


def pods_metric(name: str, average: str) -> dict:
    return {"type": "Pods", "pods": {"metric": {"name": name}, "target": {"type": "AverageValue",
                                                                          "averageValue": average}}}


def autoscaler() -> dict:
    """Scales on Triton's queue time over compute time (the Prometheus adapter serves the recording rule as a pods
    metric): above 1, requests wait longer than they compute. The speculative model is decoupled, so Triton hands it
    every request at once and the queueing happens in specdeploy's scheduler: its queued requests are the second
    signal (above 1 per pod on average). The HPA follows whichever asks for more replicas."""
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": SERVER},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVER},
                     "minReplicas": 1, "maxReplicas": MAX_REPLICAS,
                     "metrics": [pods_metric(QUEUE_COMPUTE_METRIC, "1000m"), pods_metric(WAITING_METRIC, "1")],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def pod_monitor() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": SERVER},
            "spec": {"selector": {"matchLabels": SERVER_LABELS},
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def base_objects() -> dict[str, dict]:
    """File name → object."""
    return {"serviceaccount.yaml": service_account(), "pvc.yaml": data_claim(), "build-job.yaml": build_job(),
            "deployment.yaml": deployment(), "service.yaml": service(), "pdb.yaml": disruption_budget(),
            "networkpolicy.yaml": network_policy(), "build-networkpolicy.yaml": build_network_policy(),
            "hpa.yaml": autoscaler(), "podmonitor.yaml": pod_monitor()}
