// Command kubelet-harness runs the kubelet's real device manager
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.ManagerImpl) together with the
// real topology manager, outside a kubelet, and exposes it on a small local HTTP
// API. It is deviceplane's conformance peer: device plugins (upstream ones and
// ours) register with it exactly as with a kubelet, and pods are admitted through
// the same code path the kubelet uses (topology manager Admit -> device manager
// Allocate for init containers then app containers -> GetDeviceRunContainerOptions).
//
// HTTP API (bind it to 127.0.0.1 only):
//
//	GET  /healthz              -> "ok"
//	GET  /capacity             -> {"capacity":{res:n},"allocatable":{res:n},"removed":[res],
//	                               "devices":{res:[{"id","health","numaNodes"}]}}
//	POST /admit   (a v1.Pod)   -> {"uid","admitted","reason","message","containers":[
//	                               {"name","init","devices":{res:[ids]},"runOptions":{...},"error"}]}
//	POST /remove  {"uid":...}  -> drops the pod from the active set and frees its
//	                               devices at once (UpdateAllocatedDevices, which the
//	                               kubelet runs on its next allocation)
//	GET  /pods                 -> the active pods and their devices
//
// With --pod-resources-socket PATH it also serves the kubelet's real PodResources v1 API there (podresources.go).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	cadvisorapi "github.com/google/cadvisor/info/v1"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

type allReady struct{}

func (allReady) AddSource(string) {}
func (allReady) AllReady() bool   { return true }

type harness struct {
	dm   *devicemanager.ManagerImpl
	topo topologymanager.Manager

	// admitMu serialises admissions, as the kubelet's pod admission does.
	admitMu sync.Mutex
	mu      sync.Mutex
	active  map[types.UID]*v1.Pod
	order   []types.UID
	// rejected: pods refused at admission. The kubelet marks them Failed but its pod manager keeps them until they
	// are deleted, so PodResources Get still finds them (with no devices); they are not active.
	rejected map[types.UID]*v1.Pod
}

func (h *harness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]*v1.Pod, 0, len(h.order))
	for _, uid := range h.order {
		if p, ok := h.active[uid]; ok {
			out = append(out, p)
		}
	}
	return out
}

// podByName: the kubelet's pod manager's GetPodByName: active pods, then pods rejected at admission.
func (h *harness) podByName(namespace, name string) (*v1.Pod, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, uid := range h.order {
		if p, ok := h.active[uid]; ok && p.Namespace == namespace && p.Name == name {
			return p, true
		}
	}
	for _, p := range h.rejected {
		if p.Namespace == namespace && p.Name == name {
			return p, true
		}
	}
	return nil, false
}

type jsonDevice struct {
	ID        string  `json:"id"`
	Health    string  `json:"health"`
	NUMANodes []int64 `json:"numaNodes"`
}

type envVar struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

type mount struct {
	Name          string `json:"name"`
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	ReadOnly      bool   `json:"readOnly"`
}

type deviceSpec struct {
	PathOnHost      string `json:"hostPath"`
	PathInContainer string `json:"containerPath"`
	Permissions     string `json:"permissions"`
}

type runOptions struct {
	Envs        []envVar          `json:"envs"`
	Mounts      []mount           `json:"mounts"`
	Devices     []deviceSpec      `json:"devices"`
	Annotations map[string]string `json:"annotations"`
	CDIDevices  []string          `json:"cdiDevices"`
}

type containerResult struct {
	Name       string              `json:"name"`
	Init       bool                `json:"init"`
	Devices    map[string][]string `json:"devices"`
	RunOptions *runOptions         `json:"runOptions"`
	Error      string              `json:"error,omitempty"`
}

type admitResult struct {
	UID        string            `json:"uid"`
	Namespace  string            `json:"namespace"`
	Name       string            `json:"name"`
	Admitted   bool              `json:"admitted"`
	Reason     string            `json:"reason,omitempty"`
	Message    string            `json:"message,omitempty"`
	Containers []containerResult `json:"containers"`
	DurationNS int64             `json:"durationNs"`
}

func convertRunOptions(o *devicemanager.DeviceRunContainerOptions) *runOptions {
	if o == nil {
		return nil
	}
	r := &runOptions{
		Envs: []envVar{}, Mounts: []mount{}, Devices: []deviceSpec{},
		Annotations: map[string]string{}, CDIDevices: []string{},
	}
	for _, e := range o.Envs {
		r.Envs = append(r.Envs, envVar{e.Name, e.Value})
	}
	for _, m := range o.Mounts {
		r.Mounts = append(r.Mounts, mount{m.Name, m.ContainerPath, m.HostPath, m.ReadOnly})
	}
	for _, d := range o.Devices {
		r.Devices = append(r.Devices, deviceSpec{d.PathOnHost, d.PathInContainer, d.Permissions})
	}
	for _, a := range o.Annotations {
		r.Annotations[a.Name] = a.Value
	}
	for _, c := range o.CDIDevices {
		r.CDIDevices = append(r.CDIDevices, c.Name)
	}
	sort.Slice(r.Envs, func(i, j int) bool { return r.Envs[i].Name < r.Envs[j].Name })
	sort.Slice(r.Mounts, func(i, j int) bool { return r.Mounts[i].ContainerPath < r.Mounts[j].ContainerPath })
	sort.Slice(r.Devices, func(i, j int) bool { return r.Devices[i].PathInContainer < r.Devices[j].PathInContainer })
	return r
}

func deviceIDs(rdi devicemanager.ResourceDeviceInstances) map[string][]string {
	out := map[string][]string{}
	for res, devs := range rdi {
		ids := make([]string, 0, len(devs))
		for id := range devs {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		out[res] = ids
	}
	return out
}

func numaOf(d *pluginapi.Device) []int64 {
	out := []int64{}
	if d != nil && d.Topology != nil {
		for _, n := range d.Topology.Nodes {
			out = append(out, n.ID)
		}
	}
	return out
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func (h *harness) handleCapacity(w http.ResponseWriter, r *http.Request) {
	capacity, allocatable, removed := h.dm.GetCapacity()
	resp := map[string]any{
		"capacity":    map[string]int64{},
		"allocatable": map[string]int64{},
		"removed":     removed,
		"devices":     map[string][]jsonDevice{},
	}
	for k, q := range capacity {
		resp["capacity"].(map[string]int64)[string(k)] = q.Value()
	}
	for k, q := range allocatable {
		resp["allocatable"].(map[string]int64)[string(k)] = q.Value()
	}
	if resp["removed"] == nil {
		resp["removed"] = []string{}
	}
	// GetAllocatableDevices returns only healthy devices; GetCapacity's capacity
	// counts all. Report the healthy ones with their topology.
	for res, devs := range h.dm.GetAllocatableDevices() {
		list := []jsonDevice{}
		for id, d := range devs {
			list = append(list, jsonDevice{ID: id, Health: d.Health, NUMANodes: numaOf(d)})
		}
		sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
		resp["devices"].(map[string][]jsonDevice)[res] = list
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h *harness) handleAdmit(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"error": "POST a v1.Pod"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 8<<20))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	pod := &v1.Pod{}
	if err := json.Unmarshal(body, pod); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "invalid pod JSON: " + err.Error()})
		return
	}
	if pod.UID == "" {
		pod.UID = uuid.NewUUID()
	}
	if pod.Namespace == "" {
		pod.Namespace = "default"
	}
	// Extended resources: requests default to limits (API defaulting is not run here).
	for _, cs := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range cs {
			c := &cs[i]
			if c.Resources.Requests == nil && c.Resources.Limits != nil {
				c.Resources.Requests = c.Resources.Limits.DeepCopy()
			}
		}
	}

	h.admitMu.Lock()
	defer h.admitMu.Unlock()
	// The pod is active while it is being admitted (the kubelet's pod manager
	// holds it), so UpdateAllocatedDevices does not garbage-collect it midway.
	h.mu.Lock()
	_, known := h.active[pod.UID]
	h.active[pod.UID] = pod
	delete(h.rejected, pod.UID)
	if !known {
		h.order = append(h.order, pod.UID)
	}
	h.mu.Unlock()

	start := time.Now()
	res := h.topo.Admit(&lifecycle.PodAdmitAttributes{Pod: pod})
	out := admitResult{
		UID: string(pod.UID), Namespace: pod.Namespace, Name: pod.Name,
		Admitted: res.Admit, Reason: res.Reason, Message: res.Message,
		Containers: []containerResult{},
	}
	if res.Admit {
		ctx := r.Context()
		add := func(c *v1.Container, init bool) {
			cr := containerResult{Name: c.Name, Init: init}
			opts, err := h.dm.GetDeviceRunContainerOptions(ctx, pod, c)
			if err != nil {
				cr.Error = err.Error()
			}
			cr.RunOptions = convertRunOptions(opts)
			cr.Devices = deviceIDs(h.dm.GetDevices(string(pod.UID), c.Name))
			out.Containers = append(out.Containers, cr)
		}
		for i := range pod.Spec.InitContainers {
			add(&pod.Spec.InitContainers[i], true)
		}
		for i := range pod.Spec.Containers {
			add(&pod.Spec.Containers[i], false)
		}
	} else if !known {
		// A rejected pod is not active (the kubelet marks it Failed); its pod manager still holds it.
		h.forget(pod.UID)
		h.mu.Lock()
		h.rejected[pod.UID] = pod
		h.mu.Unlock()
	}
	out.DurationNS = time.Since(start).Nanoseconds()
	writeJSON(w, http.StatusOK, out)
}

func (h *harness) forget(uid types.UID) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, wasRejected := h.rejected[uid]
	delete(h.rejected, uid)
	if _, ok := h.active[uid]; !ok {
		return wasRejected
	}
	delete(h.active, uid)
	for i, u := range h.order {
		if u == uid {
			h.order = append(h.order[:i], h.order[i+1:]...)
			break
		}
	}
	return true
}

func (h *harness) handleRemove(w http.ResponseWriter, r *http.Request) {
	var req struct {
		UID string `json:"uid"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || req.UID == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": `POST {"uid": "..."}`})
		return
	}
	found := h.forget(types.UID(req.UID))
	// Free now, as the kubelet would on its next allocation/hint call.
	h.dm.UpdateAllocatedDevices()
	writeJSON(w, http.StatusOK, map[string]bool{"removed": found})
}

func (h *harness) handlePods(w http.ResponseWriter, r *http.Request) {
	out := []map[string]any{}
	for _, p := range h.activePods() {
		ctrs := []map[string]any{}
		for _, c := range append(append([]v1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
			ctrs = append(ctrs, map[string]any{"name": c.Name, "devices": deviceIDs(h.dm.GetDevices(string(p.UID), c.Name))})
		}
		out = append(out, map[string]any{"uid": p.UID, "namespace": p.Namespace, "name": p.Name, "containers": ctrs})
	}
	writeJSON(w, http.StatusOK, out)
}

func main() {
	klog.InitFlags(nil)
	socketDir := flag.String("socket-dir", pluginapi.DevicePluginPath, "directory of the registration socket kubelet.sock (and the checkpoint)")
	httpAddr := flag.String("http", "127.0.0.1:0", "HTTP API address (host:port; 127.0.0.1 only)")
	numaNodes := flag.Int("numa-nodes", 1, "number of NUMA nodes of the simulated machine (0..N-1)")
	policy := flag.String("topology-policy", topologymanager.PolicyNone, "topology manager policy: none|best-effort|restricted|single-numa-node")
	scope := flag.String("topology-scope", topologymanager.ContainerTopologyScope, "topology manager scope: container|pod")
	podResourcesSocket := flag.String("pod-resources-socket", "", "serve the kubelet's PodResources v1 API on this unix socket (off when empty)")
	flag.Parse()
	logger := klog.Background()

	host, _, err := net.SplitHostPort(*httpAddr)
	if err != nil || (host != "127.0.0.1" && host != "localhost" && host != "::1") {
		fmt.Fprintf(os.Stderr, "--http must be a loopback host:port, got %q\n", *httpAddr)
		os.Exit(2)
	}
	dir, err := filepath.Abs(*socketDir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}

	var topology []cadvisorapi.Node
	for i := 0; i < *numaNodes; i++ {
		topology = append(topology, cadvisorapi.Node{Id: i})
	}
	topo, err := topologymanager.NewManager(topology, *policy, *scope, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "topology manager:", err)
		os.Exit(2)
	}
	dm, err := newManagerImpl(logger, filepath.Join(dir, "kubelet.sock"), topology, topo)
	if err != nil {
		fmt.Fprintln(os.Stderr, "device manager:", err)
		os.Exit(1)
	}
	topo.AddHintProvider(logger, dm)

	h := &harness{dm: dm, topo: topo, active: map[types.UID]*v1.Pod{}, rejected: map[types.UID]*v1.Pod{}}
	if err := dm.Start(logger, h.activePods, allReady{}, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		fmt.Fprintln(os.Stderr, "device manager start:", err)
		os.Exit(1)
	}

	if *podResourcesSocket != "" {
		prs, err := servePodResources(context.Background(), *podResourcesSocket, h)
		if err != nil {
			fmt.Fprintln(os.Stderr, "pod resources:", err)
			os.Exit(1)
		}
		defer func() {
			prs.Stop()
			_ = os.Remove(*podResourcesSocket)
		}()
	}

	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux.HandleFunc("/capacity", h.handleCapacity)
	mux.HandleFunc("/admit", h.handleAdmit)
	mux.HandleFunc("/remove", h.handleRemove)
	mux.HandleFunc("/pods", h.handlePods)
	ln, err := net.Listen("tcp", *httpAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	addr := ln.Addr().String()
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("kubelet-harness: socket %s, http %s, numa nodes %d, policy %s\n",
		filepath.Join(dir, "kubelet.sock"), addr, *numaNodes, *policy)

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sig
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, "serve:", err)
	}
	_ = dm.Stop(logger)
	_ = os.Remove(filepath.Join(dir, "kubelet.sock"))
}
