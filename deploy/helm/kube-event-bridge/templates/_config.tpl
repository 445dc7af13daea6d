{{/*
The config file the ConfigMap holds: config as given, with the Lease named after the release
when config.leader_election.lease_name is unset and the release's name is not the default
(two releases in one namespace must not share a Lease, nor shard and membership Leases).
*/}}
{{- define "keb.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $le := $config.leader_election | default dict }}
{{- $fullname := include "keb.fullname" . }}
{{- if and (not $le.lease_name) (ne $fullname "kube-event-bridge") }}
{{- $_ := set $le "lease_name" $fullname }}
{{- $_ := set $config "leader_election" $le }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The Lease name (the shard and membership Leases start with it). */}}
{{- define "keb.leaseName" -}}
{{- (include "keb.config" . | fromYaml).leader_election.lease_name | default "kube-event-bridge" }}
{{- end }}

{{/*
What the chart refuses before anything is installed, beyond values.schema.json: what spans
fields of the config, and settings that cannot work in a Deployment.
*/}}
{{- define "keb.checks" -}}
{{- $config := .Values.config }}
{{- /* Routes name sinks and resources the config has: values merge map by map, so a
config.sinks or config.resources given without config.routes keeps the default route. */}}
{{- $sinks := list }}
{{- range $config.sinks }}{{ $sinks = append $sinks .name }}{{ end }}
{{- $resources := list }}
{{- range $config.resources }}
{{- $apiVersion := .api_version | default .apiVersion | default "" }}
{{- $name := .name }}
{{- if not $name }}
{{- $name = lower .kind }}
{{- if contains "/" $apiVersion }}{{ $name = printf "%s.%s" $name (first (splitList "/" $apiVersion)) }}{{ end }}
{{- end }}
{{- $resources = append $resources $name }}
{{- end }}
{{- range $i, $route := $config.routes }}
{{- if not (has $route.resource $resources) }}
{{- fail (printf "config.routes[%d].resource: no resource named %q in config.resources (%s); when you set config.resources or config.sinks, set config.routes too" $i $route.resource (join ", " $resources)) }}
{{- end }}
{{- range $route.sinks }}
{{- if not (has . $sinks) }}
{{- fail (printf "config.routes[%d].sinks: no sink named %q in config.sinks (%s); when you set config.sinks or config.resources, set config.routes too" $i . (join ", " $sinks)) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Credentials never inline in the ConfigMap. */}}
{{- range $i, $sink := $config.sinks }}
{{- range $j, $server := ($sink.nats | default dict).servers }}
{{- if regexMatch "^([a-z]+://)?[^/]*@" $server }}
{{- fail (printf "config.sinks[%d].nats.servers[%d]: credentials in the URL would be stored in the ConfigMap; use nats.auth with a file from nats.existingSecret" $i $j) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Replicas. */}}
{{- $le := $config.leader_election | default dict }}
{{- if and (gt (int .Values.replicaCount) 1) (not $le.enabled) }}
{{- fail (printf "replicaCount is %d but config.leader_election.enabled is false: every replica would publish everything; enable leader election or set replicaCount: 1" (int .Values.replicaCount)) }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) $le.identity }}
{{- fail "config.leader_election.identity would be every replica's (they share the ConfigMap); leave it unset: each pod is identified by POD_NAME" }}
{{- end }}
{{- /* The admin server: reachable by the probes. */}}
{{- $address := ($config.admin | default dict).address | default "0.0.0.0:8080" }}
{{- if or (hasPrefix "127." $address) (hasPrefix "[::1]" $address) (hasPrefix "localhost" $address) }}
{{- fail (printf "config.admin.address %s listens on loopback only: the kubelet's probes and Prometheus cannot reach it; use 0.0.0.0:PORT or [::]:PORT" $address) }}
{{- end }}
{{- if eq (include "keb.adminPort" .) "0" }}
{{- fail "config.admin.address: port 0 picks a free port, which the probes and the Service cannot know; give a port" }}
{{- end }}
{{- end }}
