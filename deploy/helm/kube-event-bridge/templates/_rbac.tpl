{{/*
The ClusterRole's rules for config.resources, as YAML: list and watch on exactly the kinds
selected, one rule per API group (groups and resources sorted). A kind is mapped to its plural
with rbac.plurals, then files/builtin-plurals.yaml (every built-in kind of Kubernetes 1.36 that
lists and watches, read from a real API server's discovery by tests/helm_chart.rs). A `kind: "*"`
selection takes every resource of its group (`*`), or of every group for `apiVersion: "*"`.
*/}}
{{- define "keb.resourceRules" -}}
{{- $plurals := merge (dict) (.Values.rbac.plurals | default dict) (.Files.Get "files/builtin-plurals.yaml" | fromYaml) }}
{{- $groups := dict }}
{{- range $i, $r := .Values.config.resources }}
{{- $apiVersion := $r.api_version | default $r.apiVersion | default "" }}
{{- $group := "" }}
{{- if contains "/" $apiVersion }}{{ $group = first (splitList "/" $apiVersion) }}{{ end }}
{{- if eq $apiVersion "*" }}{{ $group = "*" }}{{ end }}
{{- $resources := get $groups $group | default list }}
{{- if eq $r.kind "*" }}
{{- $resources = append $resources "*" }}
{{- else }}
{{- $key := printf "%s/%s" (ternary "core" $group (eq $group "")) $r.kind }}
{{- $plural := get $plurals $key }}
{{- if not $plural }}
{{- fail (printf "config.resources[%d]: the chart does not know the plural of kind %s (%s); name it in rbac.plurals, e.g. --set rbac.plurals.%s=%ss" $i $r.kind $apiVersion (replace "." "\\." $key) (lower $r.kind)) }}
{{- end }}
{{- $resources = append $resources $plural }}
{{- end }}
{{- $_ := set $groups $group $resources }}
{{- end }}
{{- range $group := keys $groups | sortAlpha }}
{{- $resources := get $groups $group | uniq | sortAlpha }}
{{- if has "*" $resources }}{{ $resources = list "*" }}{{ end }}
- apiGroups: [{{ $group | quote }}]
  resources: {{ $resources | toJson }}
  verbs: ["list", "watch"]
{{- end }}
{{- end }}
