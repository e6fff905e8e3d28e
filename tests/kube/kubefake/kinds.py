"""lightkube classes for every kind the fake serves, so tests address the fake and a real cluster the same way."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod, PodTemplate, Service
from lightkube.resources.events_v1 import Event as EventV1

from . import resources as r

JobSet = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
PyTorchJob = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")
TFJob = create_namespaced_resource("kubeflow.org", "v1", "TFJob", "tfjobs")
MPIJob = create_namespaced_resource("kubeflow.org", "v2beta1", "MPIJob", "mpijobs")
RayJob = create_namespaced_resource("ray.io", "v1", "RayJob", "rayjobs")
Notebook = create_namespaced_resource("kubeflow.org", "v1", "Notebook", "notebooks")
LeaderWorkerSet = create_namespaced_resource("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets")
RayCluster = create_namespaced_resource("ray.io", "v1", "RayCluster", "rayclusters")
ProvisioningRequest = create_namespaced_resource("autoscaling.x-k8s.io", "v1", "ProvisioningRequest",
                                                 "provisioningrequests")

LIGHTKUBE_KINDS: dict[r.ResourceType, Any] = {
    r.NAMESPACES: Namespace,
    r.NODES: Node,
    r.PODS: Pod,
    r.EVENTS: Event,
    r.NEW_EVENTS: EventV1,
    r.CONFIGMAPS: ConfigMap,
    r.SERVICES: Service,
    r.JOBS: Job,
    r.STATEFULSETS: StatefulSet,
    r.JOBSETS: JobSet,
    r.PYTORCHJOBS: PyTorchJob,
    r.TFJOBS: TFJob,
    r.MPIJOBS: MPIJob,
    r.RAYJOBS: RayJob,
    r.RAYCLUSTERS: RayCluster,
    r.NOTEBOOKS: Notebook,
    r.LEADERWORKERSETS: LeaderWorkerSet,
    r.POD_TEMPLATES: PodTemplate,
    r.PROVISIONING_REQUESTS: ProvisioningRequest,
}
