// Command kube-feature-gates prints the feature gates kube-proxy registers, as JSON: each gate's
// stage, default and lock at the binary's own version, and the gates each one depends on.
// nfproxy's --feature-gates answers from this list (nfproxy/cli/kube_feature_gates.json), so an
// unknown, locked or pre-alpha gate is refused as kube-proxy refuses it; a test holds the
// checked-in list to this program's output (`scripts/kube feature-gates`).
package main

import (
	"encoding/json"
	"os"
	"sort"

	"k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/featuregate"

	_ "k8s.io/kubernetes/cmd/kube-proxy/app" // registers every gate kube-proxy has, as its main does
)

type gate struct {
	Name      string   `json:"name"`
	Stage     string   `json:"stage"`
	Default   bool     `json:"default"`
	Locked    bool     `json:"locked"`
	DependsOn []string `json:"dependsOn,omitempty"`
}

func main() {
	gates := feature.DefaultMutableFeatureGate
	current := gates.GetAll() // the spec at the binary's version; pre-alpha gates left out
	deps := gates.Dependencies()
	var out []gate
	for name := range gates.GetAllVersioned() {
		g := gate{Name: string(name), Stage: string(featuregate.PreAlpha)}
		if spec, ok := current[name]; ok {
			g.Stage, g.Default, g.Locked = string(spec.PreRelease), spec.Default, spec.LockToDefault
			if spec.PreRelease == featuregate.GA {
				g.Stage = "GA" // the empty string in component-base
			}
		}
		for _, d := range deps[name] {
			g.DependsOn = append(g.DependsOn, string(d))
		}
		sort.Strings(g.DependsOn)
		out = append(out, g)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(map[string]any{"kubeProxy": version(), "gates": out}); err != nil {
		os.Exit(1)
	}
}

// version is the kube-proxy version the list is of (scripts/kube passes its go.mod's).
func version() string {
	if len(os.Args) > 1 {
		return os.Args[1]
	}
	return "unknown"
}
