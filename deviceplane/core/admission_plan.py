"""Admitting one pod as the kubelet does (spec §4.7.1-4.7.2, §4.10 pre-start, §4.12), as a pure step machine.

`admit_pod` is a generator: it yields the plugin RPCs it needs (`PreferredCall`, `AllocateCall`) and is sent their
answers. Everything between two RPCs is synchronous, so choosing devices and reserving them is one atomic step even
with many admissions interleaved on one event loop. The agent executes the RPCs; tests drive it with fake answers.
If an RPC fails the driver closes the generator and calls `Allocator.release_pod`, so nothing is left held.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.allocator import AllocationError, AllocationResult, Allocator, AskPreferred, Chosen, ReusePool
from deviceplane.core.names import is_extended_resource_name
from deviceplane.core.pods import Container, Pod
from deviceplane.core.topology import POLICY_NONE, TopologyHint, merge_hints, rejection_reason, resource_hints


@dataclass(frozen=True, slots=True)
class PreferredCall:
    """GetPreferredAllocation for one container's resource; send back the preferred IDs (a set, maybe empty)."""

    container: str
    resource: str
    request: AskPreferred


@dataclass(frozen=True, slots=True)
class AllocateCall:
    """Allocate for one container's resource; send back the ContainerAllocateResponse (container_responses[0])."""

    container: str
    resource: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PodOutcome:
    restored: bool  # admitted before an agent restart: nothing was asked of any plugin
    hints: dict[str, TopologyHint]  # the NUMA affinity each container was allocated with


Step = PreferredCall | AllocateCall
PodAdmission = Generator[Step, object, PodOutcome]


def container_affinity(
    allocator: Allocator, pod: Pod, container: Container, reuse: ReusePool, policy: str, numa: Sequence[int]
) -> TopologyHint:
    """The topology manager's decision for one container, from the device manager's hints (spec §4.12)."""
    if policy == POLICY_NONE or not numa:
        return TopologyHint(None, True)  # upstream admitPolicyNone: no hint provider is asked
    hints: dict[str, list[TopologyHint] | None] = {}
    for resource, count in container.limits:
        # A zero limit still gives hints upstream (every mask, single nodes preferred), and they narrow the affinity
        # the container's other resources are allocated with.
        if not allocator.is_device_plugin_resource(resource):
            continue
        already = allocator.held(pod.uid, container.name, resource)
        hints[resource] = resource_hints(
            allocator.resource_devices(resource), count, already, reuse.get(resource), numa
        )
    decision = merge_hints(policy, numa, hints)
    if not decision.admit:
        # Counted under the container's first device resource: the policy judged them together.
        reason = rejection_reason(policy, container.name, hints)
        raise AllocationError(reason, AllocationResult.TOPOLOGY, next(iter(hints), ""))
    return decision.hint


def admit_pod(allocator: Allocator, pod: Pod, policy: str = "none", numa: Sequence[int] = ()) -> PodAdmission:
    """Init containers, then app containers; one Allocate per container per resource (spec §4.7.1-4.7.2)."""
    containers = [(c.name, c.limits) for c in pod.all_containers]
    if allocator.is_restored(pod.uid, containers):
        return PodOutcome(restored=True, hints={})
    for resource, count in pod.device_requests().items():
        # The kubelet skips resources no plugin serves and leaves them to its node-allocatable predicate; without a
        # kubelet this is the only check, so such a pod is refused here, with the device manager's own message.
        if count > 0 and is_extended_resource_name(resource) and not allocator.is_device_plugin_resource(resource):
            raise AllocationError(
                f"cannot allocate unregistered device {resource}", AllocationResult.UNREGISTERED, resource
            )
    reuse = ReusePool()
    chosen_hints: dict[str, TopologyHint] = {}
    for container in pod.all_containers:
        hint = container_affinity(allocator, pod, container, reuse, policy, numa)
        chosen_hints[container.name] = hint
        for resource, count in container.limits:
            if not allocator.is_device_plugin_resource(resource):
                continue
            args = (pod.uid, container.name, resource, count, reuse.get(resource), hint.affinity)
            decision = allocator.devices_to_allocate(*args)
            if isinstance(decision, AskPreferred):
                answer = yield PreferredCall(container.name, resource, decision)
                # Re-decided against the state after the await: the answer is used only where still free.
                decision = allocator.devices_to_allocate(*args, preferred=_preferred_answer(answer))
            if not isinstance(decision, Chosen):
                raise RuntimeError(f"GetPreferredAllocation asked twice for {resource}")  # an allocator bug
            if not decision.devices:
                continue
            allocator.reserve(pod.uid, container.name, resource, decision.devices)
            response = yield AllocateCall(container.name, resource, decision.devices)
            allocator.commit(pod.uid, container.name, resource, decision.devices, _allocate_answer(response))
        reuse.after_container(
            allocator.held_by_container(pod.uid, container.name), container.init, container.restartable
        )
    return PodOutcome(restored=False, hints=chosen_hints)


def _preferred_answer(answer: object) -> frozenset[str]:
    if not isinstance(answer, set | frozenset | list | tuple):
        raise TypeError(f"PreferredCall must be answered with device IDs, got {type(answer).__name__}")
    return frozenset(answer)


def _allocate_answer(answer: object) -> pb.ContainerAllocateResponse:
    if not isinstance(answer, pb.ContainerAllocateResponse):
        raise TypeError(f"AllocateCall must be answered with a ContainerAllocateResponse, got {type(answer).__name__}")
    return answer


@dataclass(frozen=True, slots=True)
class PreStartCall:
    container: str
    resource: str
    devices: tuple[str, ...]


def pre_start_calls(allocator: Allocator, pod: Pod) -> list[PreStartCall]:
    """Spec §4.10 callPreStartContainerIfNeeded for every container and resource with a non-zero request whose
    plugin asks for it; raises with upstream's message when the devices are not in the local cache."""
    calls = []
    for container in pod.all_containers:
        for resource, count in container.limits:
            if count == 0 or not allocator.is_device_plugin_resource(resource):
                continue
            endpoint = allocator.plugin_endpoint(resource)
            if endpoint is None:
                raise AllocationError(
                    f"endpoint not found in cache for a registered resource: {resource}",
                    AllocationResult.NO_ENDPOINT,
                    resource,
                )
            if endpoint.options is None or not endpoint.options.pre_start_required:
                continue
            devices = allocator.held(pod.uid, container.name, resource)
            if not devices:
                raise AllocationError(
                    f"no devices found allocated in local cache for pod {pod.uid}, container {container.name}, "
                    f"resource {resource}",
                    AllocationResult.INTERNAL,
                    resource,
                )
            calls.append(PreStartCall(container.name, resource, tuple(sorted(devices))))
    return calls
