//go:build tools

// controller-gen (built by kube.sh) and the API packages it reads: imported here so that
// `go mod tidy` keeps what loading them needs, and controller-gen, run in this module,
// finds them at the pinned versions.
package tools

import (
	_ "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	_ "sigs.k8s.io/controller-tools/cmd/controller-gen"
)
