// Command allocate-bench plays the kubelet's side of the device-plugin Allocate RPC for
// benchmarks/proxy.py: a Go gRPC client (grpc-go and the kubelet's deviceplugin v1beta1 API,
// dialled as the kubelet's device manager dials a plugin) that calls Allocate with the same
// request on several unix sockets in turn, N rounds, and prints every call's latency as JSON.
//
//	allocate-bench --socket A --socket B [--socket C] --devices Dev-1,Dev-2 [--calls 3000] [--warmup 200]
//	-> {"sockets":[A,B,...],"ms":[[...A's latencies...],[...B's...],...]}
//
// Each round calls every socket once, starting from a different one each round (so no socket
// always goes first); round i of each list is one "pair". Before timing, the warm-up checks that
// every socket answers the same response bytes.
//
//	allocate-bench --forward PLUGIN_SOCKET --listen SOCKET
//
// instead serves a bare Go forwarder on SOCKET: Allocate passed to the plugin, nothing else (the
// cost of one more gRPC hop outside Python, for scale).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type socketList []string

func (s *socketList) String() string     { return strings.Join(*s, ",") }
func (s *socketList) Set(v string) error { *s = append(*s, v); return nil }

type result struct {
	Sockets []string    `json:"sockets"`
	Ms      [][]float64 `json:"ms"`
}

// dial connects as the kubelet's device-plugin client does (unix socket, authority "localhost", insecure).
func dial(path string) (*grpc.ClientConn, error) {
	return grpc.NewClient("passthrough:///"+path,
		grpc.WithAuthority("localhost"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
}

// forwarder passes Allocate to a plugin; the other RPCs are unimplemented.
type forwarder struct {
	pluginapi.UnimplementedDevicePluginServer
	plugin pluginapi.DevicePluginClient
}

func (f *forwarder) Allocate(ctx context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	return f.plugin.Allocate(ctx, request)
}

func forward(pluginSocket, listen string) {
	conn, err := dial(pluginSocket)
	if err != nil {
		fail("dial %s: %v", pluginSocket, err)
	}
	listener, err := net.Listen("unix", listen)
	if err != nil {
		fail("listen %s: %v", listen, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, &forwarder{plugin: pluginapi.NewDevicePluginClient(conn)})
	if err := server.Serve(listener); err != nil {
		fail("serve: %v", err)
	}
}

func main() {
	var sockets socketList
	flag.Var(&sockets, "socket", "a plugin (or proxy) socket to call; repeat for each")
	devices := flag.String("devices", "", "comma-separated device IDs of the one container request")
	calls := flag.Int("calls", 3000, "timed rounds (one call per socket each)")
	warmup := flag.Int("warmup", 200, "untimed rounds first")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of each call")
	forwardTo := flag.String("forward", "", "serve a bare forwarder to this plugin socket (with --listen)")
	listen := flag.String("listen", "", "the forwarder's socket")
	flag.Parse()
	if *forwardTo != "" {
		forward(*forwardTo, *listen)
		return
	}
	if len(sockets) == 0 || *devices == "" {
		fmt.Fprintln(os.Stderr, "allocate-bench: need --socket (one or more) and --devices")
		os.Exit(2)
	}
	request := &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: strings.Split(*devices, ",")},
	}}
	clients := make([]pluginapi.DevicePluginClient, len(sockets))
	for i, path := range sockets {
		conn, err := dial(path)
		if err != nil {
			fail("dial %s: %v", path, err)
		}
		defer conn.Close()
		clients[i] = pluginapi.NewDevicePluginClient(conn)
	}
	allocate := func(i int) (*pluginapi.AllocateResponse, time.Duration) {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		defer cancel()
		start := time.Now()
		response, err := clients[i].Allocate(ctx, request)
		took := time.Since(start)
		if err != nil {
			fail("Allocate on %s: %v", sockets[i], err)
		}
		return response, took
	}
	for round := 0; round < *warmup; round++ {
		var first []byte
		for i := range clients {
			response, _ := allocate(i)
			wire, err := proto.MarshalOptions{Deterministic: true}.Marshal(response)
			if err != nil {
				fail("marshal: %v", err)
			}
			if i == 0 {
				first = wire
			} else if !bytes.Equal(wire, first) {
				fail("%s answered differently from %s", sockets[i], sockets[0])
			}
		}
	}
	out := result{Sockets: sockets, Ms: make([][]float64, len(sockets))}
	for i := range out.Ms {
		out.Ms[i] = make([]float64, *calls)
	}
	for round := 0; round < *calls; round++ {
		for k := range clients {
			i := (round + k) % len(clients)
			_, took := allocate(i)
			out.Ms[i][round] = float64(took.Nanoseconds()) / 1e6
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("write: %v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "allocate-bench: "+format+"\n", args...)
	os.Exit(1)
}
