// Command etcd is the etcd server, built from go.etcd.io/etcd/server/v3 at the version
// k8s.io/kubernetes itself requires, so kube-apiserver runs against the etcd it was released with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
