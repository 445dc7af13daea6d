{{/* The release's objects are named after it: "kube-event-bridge" for a release of that name. */}}
{{- define "keb.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "keb.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "keb.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keb.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "keb.labels" -}}
{{ include "keb.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "keb.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "keb.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The admin server's port, from config.admin.address (8080 by default). */}}
{{- define "keb.adminPort" -}}
{{- $address := (.Values.config.admin | default dict).address | default "0.0.0.0:8080" }}
{{- last (splitList ":" $address) }}
{{- end }}

{{/* Shards of the config (1: single-leader mode). */}}
{{- define "keb.shards" -}}
{{- (.Values.config.sharding | default dict).shards | default 1 | int }}
{{- end }}

{{- define "keb.leaderElection" -}}
{{- if (.Values.config.leader_election | default dict).enabled }}true{{ end }}
{{- end }}

{{/* The Lease namespace: config.leader_election.namespace, else the release's (the pod's). */}}
{{- define "keb.leaseNamespace" -}}
{{- (.Values.config.leader_election | default dict).namespace | default .Release.Namespace }}
{{- end }}
