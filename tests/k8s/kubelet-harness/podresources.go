package main

// The kubelet's real PodResources v1 server (k8s.io/kubernetes/pkg/kubelet/apis/podresources) over the real
// device manager, served the way the kubelet serves it (pkg/kubelet/server.ListenAndServePodResources: a gRPC
// server with the same rate limiter, on a unix socket). Only the providers are ours: the harness's pods,
// the device manager's devices, and empty CPU/memory/dynamic-resources answers (the harness manages none).

import (
	"context"
	"errors"
	"net"
	"os"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// devicesProvider adapts the device manager as the kubelet's container manager does
// (cm.containerDevicesFromResourceDeviceInstances: one entry per device and NUMA node, none without topology).
type devicesProvider struct{ dm *devicemanager.ManagerImpl }

func (d devicesProvider) UpdateAllocatedDevices() { d.dm.UpdateAllocatedDevices() }

func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesapi.ContainerDevices {
	return containerDevices(d.dm.GetDevices(podUID, containerName))
}

func (d devicesProvider) GetAllocatableDevices() []*podresourcesapi.ContainerDevices {
	return containerDevices(d.dm.GetAllocatableDevices())
}

func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesapi.ContainerDevices {
	var out []*podresourcesapi.ContainerDevices
	for resource, instances := range devs {
		for id, dev := range instances {
			topology := dev.GetTopology()
			if topology == nil {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: []string{id}})
				continue
			}
			for _, node := range topology.GetNodes() {
				out = append(out, &podresourcesapi.ContainerDevices{
					ResourceName: resource,
					DeviceIds:    []string{id},
					Topology:     &podresourcesapi.TopologyInfo{Nodes: []*podresourcesapi.NUMANode{{ID: node.GetID()}}},
				})
			}
		}
	}
	return out
}

// podsProvider: the harness's admitted pods are the kubelet's active pods; GetPodByName also finds a pod rejected
// at admission, as the kubelet's pod manager (its pods provider) holds it until it is deleted.
type podsProvider struct{ h *harness }

func (p podsProvider) GetActivePods() []*v1.Pod { return p.h.activePods() }
func (p podsProvider) GetPods() []*v1.Pod       { return p.h.activePods() }
func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	return p.h.podByName(namespace, name)
}

// noResources: the harness has no CPU, memory or DRA managers.
type noResources struct{}

func (noResources) GetCPUs(string, string) []int64                              { return nil }
func (noResources) GetAllocatableCPUs() []int64                                 { return nil }
func (noResources) GetMemory(string, string) []*podresourcesapi.ContainerMemory { return nil }
func (noResources) GetAllocatableMemory() []*podresourcesapi.ContainerMemory    { return nil }
func (noResources) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesapi.DynamicResource {
	return nil
}

// servePodResources listens on socketPath (a stale socket is replaced, as the kubelet's util.CreateListener does)
// and serves PodResourcesLister v1 until the returned server is stopped.
func servePodResources(ctx context.Context, socketPath string, h *harness) (*grpc.Server, error) {
	if err := os.Remove(socketPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	ln, err := net.Listen("unix", socketPath)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer(apisgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	providers := podresources.PodResourcesProviders{
		Pods:             podsProvider{h},
		Devices:          devicesProvider{h.dm},
		Cpus:             noResources{},
		Memory:           noResources{},
		DynamicResources: noResources{},
	}
	podresourcesapi.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))
	go func() { _ = server.Serve(ln) }()
	return server, nil
}
