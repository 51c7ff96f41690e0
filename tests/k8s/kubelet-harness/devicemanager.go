package main

import (
	_ "unsafe" // for go:linkname

	cadvisorapi "github.com/google/cadvisor/info/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// The exported NewManagerImpl hard-codes the registration socket to
// /var/lib/kubelet/device-plugins/kubelet.sock. The package-internal
// constructor it delegates to takes the socket path (the upstream unit tests
// use it the same way), so we link to it directly. The checkpoint lives in the
// socket's directory, exactly as in the kubelet.
//
//go:linkname newManagerImpl k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newManagerImpl(logger klog.Logger, socketPath string, topology []cadvisorapi.Node, topologyAffinityStore topologymanager.Store) (*devicemanager.ManagerImpl, error)
