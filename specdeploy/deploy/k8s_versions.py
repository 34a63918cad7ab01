"""A pipeline version's folders on the data volume and the lease its containers hold (pods/versions.py; review W2).

The version is the pipeline's name and a key hashed from what its engines and repository are made of, as far as
the overlay knows it: the pipeline file, the image (its specdeploy, Triton model code and TensorRT-LLM) and the GPU
product the engines are built for. A rollout, an old-ReplicaSet pod started mid-rollout and a revert each find their
own folders: `engines/<version>/` and `models/<version>/`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from specdeploy.deploy import k8s_base as base

VERSIONS = ["python3", "-m", "specdeploy.pods.versions", "hold"]


def version_key(pipeline_hash: str, gpu_product: str | None) -> str:
    """Ten hex digits (pods/versions.py KEY): of the overlay's pipeline hash (pipeline file and image) and the GPU."""
    return hashlib.sha256(f"{pipeline_hash}\n{gpu_product or ''}".encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Version:
    """`name`: `<pipeline name>-<key>`; `collect_after_s`: how long after its last start an unheld version may be
    collected (past the build's deadline and the engines' load, so a pod between its build and its server keeps it)."""

    name: str
    collect_after_s: int

    @property
    def engines(self) -> str:
        """The build's SPECDEPLOY_ENGINES: the engine is `<this>/<pipeline name>`."""
        return f"{base.ENGINES_DIR}/{self.name}"

    @property
    def repository(self) -> str:
        return f"{base.MODELS_DIR}/{self.name}"

    @property
    def lease(self) -> str:
        return f"{base.MODELS_DIR}/{self.name}.lease"

    def environment(self) -> list[dict]:
        """base.environment with this version's engines root."""
        return [{**item, "value": self.engines} if item["name"] == "SPECDEPLOY_ENGINES" else item
                for item in base.environment()]

    def holding(self, wait: bool = False) -> list[str]:
        """A serving container's command prefix: the server runs holding the lease (read-only: never creates it);
        `wait` for the lease to exist first (a multinode worker, which starts before the build Job has made it)."""
        return [*VERSIONS, "--lease", self.lease, *(["--wait"] if wait else []), "--"]

    def building(self, collect: bool, deadline_s: int | None = None) -> list[str]:
        """A build or package step's prefix: holds the lease and records this start; the first step (`collect`) also
        removes superseded versions no pod holds; `deadline_s` stops a step that runs longer (review M2)."""
        command = [*VERSIONS, "--lease", self.lease, "--touch"]
        if collect:
            command += ["--collect-after", str(self.collect_after_s), "--engines", base.ENGINES_DIR]
        if deadline_s is not None:
            command += ["--deadline", str(deadline_s)]
        return [*command, "--"]
