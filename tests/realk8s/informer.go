package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"sync"
	"syscall"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// line is one notification as the reference stream prints it.
type line struct {
	// add, update, sync (an update whose old and new resourceVersion are equal: a resync),
	// delete, or synced (once, when the handler has seen the initial list).
	Type            string          `json:"type"`
	Key             string          `json:"key,omitempty"`
	ResourceVersion string          `json:"resource_version,omitempty"`
	OldVersion      string          `json:"old_resource_version,omitempty"`
	FinalStateUnkn  bool            `json:"final_state_unknown,omitempty"`
	InitialList     bool            `json:"initial_list,omitempty"`
	Object          json.RawMessage `json:"object,omitempty"`
}

type printer struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (p *printer) print(l line) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.enc.Encode(l); err != nil {
		fmt.Fprintf(os.Stderr, "informer: write: %v\n", err)
		os.Exit(1)
	}
}

func objectLine(kind string, obj interface{}) line {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		fmt.Fprintf(os.Stderr, "informer: unexpected object %T\n", obj)
		os.Exit(1)
	}
	raw, err := u.MarshalJSON()
	if err != nil {
		fmt.Fprintf(os.Stderr, "informer: encode: %v\n", err)
		os.Exit(1)
	}
	key, _ := cache.MetaNamespaceKeyFunc(u)
	return line{Type: kind, Key: key, ResourceVersion: u.GetResourceVersion(), Object: raw}
}

func runInformer(args []string) int {
	fs := flag.NewFlagSet("informer", flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (required)")
	group := fs.String("group", "", "API group (empty for the core group)")
	version := fs.String("version", "v1", "API version")
	resource := fs.String("resource", "configmaps", "resource (plural)")
	namespace := fs.String("namespace", "", "namespace (empty: all namespaces)")
	resync := fs.Duration("resync", 0, "resync period (0: none)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "informer: --kubeconfig is required")
		return 2
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "informer: kubeconfig %s: %v\n", *kubeconfig, err)
		return 1
	}
	config.QPS, config.Burst = 1000, 1000
	client, err := dynamic.NewForConfig(config)
	if err != nil {
		fmt.Fprintf(os.Stderr, "informer: client: %v\n", err)
		return 1
	}
	gvr := schema.GroupVersionResource{Group: *group, Version: *version, Resource: *resource}
	factory := dynamicinformer.NewFilteredDynamicSharedInformerFactory(client, *resync, *namespace, nil)
	informer := factory.ForResource(gvr).Informer()

	out := &printer{enc: json.NewEncoder(os.Stdout)}
	registration, err := informer.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj interface{}, isInInitialList bool) {
			l := objectLine("add", obj)
			l.InitialList = isInInitialList
			out.print(l)
		},
		UpdateFunc: func(oldObj, newObj interface{}) {
			kind := "update"
			old := oldObj.(*unstructured.Unstructured)
			if old.GetResourceVersion() == newObj.(*unstructured.Unstructured).GetResourceVersion() {
				kind = "sync"
			}
			l := objectLine(kind, newObj)
			l.OldVersion = old.GetResourceVersion()
			out.print(l)
		},
		DeleteFunc: func(obj interface{}) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				// client-go leaves Obj nil when the cache had no object for the key.
				l := line{Type: "delete", Key: tomb.Key}
				if tomb.Obj != nil {
					l = objectLine("delete", tomb.Obj)
					l.Key = tomb.Key
				}
				l.FinalStateUnkn = true
				out.print(l)
				return
			}
			out.print(objectLine("delete", obj))
		},
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "informer: handler: %v\n", err)
		return 1
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	factory.Start(ctx.Done())
	if cache.WaitForCacheSync(ctx.Done(), registration.HasSynced) {
		out.print(line{Type: "synced"})
	}
	<-ctx.Done()
	factory.Shutdown()
	return 0
}

func printVersions() {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		fmt.Println("no build info")
		return
	}
	for _, dep := range info.Deps {
		switch dep.Path {
		case "k8s.io/kubernetes", "go.etcd.io/etcd/server/v3", "k8s.io/client-go":
			v := dep.Version
			if dep.Replace != nil {
				v = dep.Replace.Version
			}
			fmt.Printf("%s %s\n", dep.Path, v)
		}
	}
}
