// Command etcd is the upstream etcd server, built from Go modules: a wrapper
// main is needed because go.etcd.io/etcd/server/v3 cannot be `go install`ed.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
