// Command realk8s is a multi-call binary holding the real Kubernetes parts the test suite runs
// on loopback: the upstream kube-apiserver, etcd 3.6, and client-go's own dynamic shared
// informer as the reference stream our informer is compared with.
//
//	realk8s kube-apiserver [flags]   upstream kube-apiserver (k8s.io/kubernetes v1.36.3)
//	realk8s etcd [flags]             upstream etcd (go.etcd.io/etcd/server/v3)
//	realk8s informer [flags]         client-go informer printing one JSON line per notification
//	realk8s version                  the versions built in
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"
	_ "time/tzdata" // for timeZone support in CronJob (as upstream's kube-apiserver main)

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go's prometheus plugins
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric registration
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: realk8s kube-apiserver|etcd|informer|version [flags]")
		os.Exit(2)
	}
	exitWithParent()
	tool := os.Args[1]
	// Each tool sees itself as argv[0], as if it were its own binary.
	os.Args = append([]string{tool}, os.Args[2:]...)
	switch tool {
	case "kube-apiserver":
		os.Exit(cli.Run(app.NewAPIServerCommand()))
	case "etcd":
		etcdmain.Main(os.Args)
	case "informer":
		os.Exit(runInformer(os.Args[1:]))
	case "version":
		printVersions()
	default:
		fmt.Fprintf(os.Stderr, "realk8s: unknown tool %q (kube-apiserver, etcd, informer, version)\n", tool)
		os.Exit(2)
	}
}

// exitWithParent ends the process when the process named by REALK8S_EXIT_WITH_PARENT (a pid:
// the test binary that started it) is no longer its parent. Test binaries may keep a cluster
// in a static, which is never dropped, and a test binary that aborts drops nothing, so
// without this an etcd and an API server would outlive the test run. (PR_SET_PDEATHSIG would
// follow the starting thread, not the process.) The pid is passed rather than read at start,
// so that a parent gone before this runs is noticed too.
func exitWithParent() {
	value := os.Getenv("REALK8S_EXIT_WITH_PARENT")
	if value == "" {
		return
	}
	parent, err := strconv.Atoi(value)
	if err != nil {
		fmt.Fprintf(os.Stderr, "realk8s: REALK8S_EXIT_WITH_PARENT=%q is not a pid\n", value)
		os.Exit(2)
	}
	check := func() {
		if os.Getppid() != parent {
			os.Exit(3)
		}
	}
	check()
	go func() {
		for range time.Tick(500 * time.Millisecond) {
			check()
		}
	}()
}
