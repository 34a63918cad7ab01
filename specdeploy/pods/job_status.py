"""The build Job's own status, read from the Kubernetes API by the serving pods' wait (pods/build_journal.py).

The journal cannot show a Job that ended without its wrapper writing: DeadlineExceeded (its pods deleted), an OOM
kill of the whole container on cgroup v2, a pod never scheduled or whose image cannot be pulled (both end in
DeadlineExceeded). The Job's `Failed` condition shows each of them, with reason DeadlineExceeded,
BackoffLimitExceeded or PodFailurePolicy (kubernetes/api batch/v1/types.go, at 2676848e as kubernetes-sigs/jobset's
webhook cites it); newer controllers set FailureTarget first, while the Job's pods terminate.

Only the wait's container holds a token (a projected one, mounted there alone), and its Role may `get` that one Job
by name. Where no token is mounted (a local run, `make image-test`) or the API cannot be read, the wait goes on with
its journal and its deadline. Standard library only: the wait runs before anything else in the pod.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # where the wait mounts its token
FAILED_CONDITIONS = ("Failed", "FailureTarget")
COMPLETE_CONDITIONS = ("Complete", "SuccessCriteriaMet")  # SuccessCriteriaMet: newer controllers, set first
TIMEOUT_S = 10


@dataclass(frozen=True)
class JobReader:
    """Reads one Job: `api` the API server's URL, `credentials` a directory with `token`, `namespace` and
    `ca.crt` (as a pod's service account mount has them)."""

    job: str
    api: str
    credentials: Path

    @classmethod
    def in_cluster(cls, job: str, credentials: Path = SERVICE_ACCOUNT_DIR) -> JobReader | None:
        """The reader for this pod, or None where it has no token or no API server is named in its environment."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not (credentials / "token").is_file() or not host or not port:
            return None
        host = f"[{host}]" if ":" in host else host  # an IPv6 cluster
        return cls(job, f"https://{host}:{port}", credentials)

    def url(self) -> str:
        namespace = (self.credentials / "namespace").read_text().strip()
        return f"{self.api}/apis/batch/v1/namespaces/{namespace}/jobs/{self.job}"

    def read(self) -> dict | None:
        """The Job object, or None where it does not exist (not created yet, or removed after its TTL). Raises
        OSError (urllib's errors are OSErrors) where the API cannot be read."""
        token = (self.credentials / "token").read_text().strip()  # the kubelet rotates it: read it each time
        request = urllib.request.Request(self.url(), headers={"Authorization": f"Bearer {token}",
                                                              "Accept": "application/json"})
        context = None
        if self.api.startswith("https:"):
            context = ssl.create_default_context(cafile=str(self.credentials / "ca.crt"))
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise


def failure(job: dict | None) -> str | None:
    """Why the Job has failed, from its Failed (or FailureTarget) condition, or None while it has not."""
    if not job:
        return None
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") in FAILED_CONDITIONS and condition.get("status") == "True":
            reason = condition.get("reason") or condition["type"]
            message = condition.get("message")
            return f"{reason}: {message}" if message else reason
    return None


def completed(job: dict | None) -> bool:
    """Whether the Job has succeeded (its Complete condition, or SuccessCriteriaMet while its pods terminate): a
    Complete Job never runs again, whatever is applied with its name (review W1)."""
    if not job:
        return False
    return any(condition.get("type") in COMPLETE_CONDITIONS and condition.get("status") == "True"
               for condition in job.get("status", {}).get("conditions") or [])
