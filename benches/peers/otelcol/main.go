// otelcol-peers: the OpenTelemetry Collector v0.111.0 with exactly the components the peers
// bench (benches/peers.rs) compares kube-event-bridge with: the k8sobjects receiver, the
// batch processor and the kafka exporter. Built from the Go module proxy by
// scripts/build-peers, as the collector builder (ocb) would generate it; run as
// `otelcol-peers --config FILE`.
package main

import (
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/kafkaexporter"
	"github.com/open-telemetry/opentelemetry-collector-contrib/receiver/k8sobjectsreceiver"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
)

func components() (otelcol.Factories, error) {
	var err error
	factories := otelcol.Factories{}
	if factories.Receivers, err = receiver.MakeFactoryMap(k8sobjectsreceiver.NewFactory()); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Processors, err = processor.MakeFactoryMap(batchprocessor.NewFactory()); err != nil {
		return otelcol.Factories{}, err
	}
	if factories.Exporters, err = exporter.MakeFactoryMap(kafkaexporter.NewFactory()); err != nil {
		return otelcol.Factories{}, err
	}
	return factories, nil
}

func main() {
	settings := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol-peers",
			Description: "OpenTelemetry Collector: k8sobjects receiver, batch processor, kafka exporter",
			Version:     "v0.111.0",
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{envprovider.NewFactory(), fileprovider.NewFactory()},
				DefaultScheme:     "env",
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
