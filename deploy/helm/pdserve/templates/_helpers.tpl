{{/*
A DNS-label-safe form of a string: lower case, runs of anything outside [a-z0-9] as one
"-", no leading or trailing "-".
*/}}
{{- define "pdserve.sanitize" -}}
{{- regexReplaceAll "[^a-z0-9]+" (lower .) "-" | trimAll "-" -}}
{{- end -}}

{{- define "pdserve.name" -}}
{{- include "pdserve.sanitize" (default .Chart.Name .Values.nameOverride) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The base of every resource name: <release>-<model.name> (sanitised), at most 40
characters so that "<base>-decode-headless" and the etcd StatefulSet's pod labels fit
in 63.
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- include "pdserve.sanitize" .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $release := include "pdserve.sanitize" .Release.Name -}}
{{- $model := include "pdserve.sanitize" .Values.model.name -}}
{{- if contains $model $release -}}
{{- $release | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" $release $model | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.cluster" -}}
{{- default (include "pdserve.fullname" .) .Values.clusterName -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
pdserve.io/model: {{ include "pdserve.sanitize" .Values.model.name | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "decode"). */}}
{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.etcdName" -}}{{ include "pdserve.fullname" . }}-etcd{{- end -}}
{{- define "pdserve.rayHeadName" -}}{{ include "pdserve.fullname" . }}-ray-head{{- end -}}

{{/* etcd endpoints, comma-separated: the given ones, else the chart's etcd Service. */}}
{{- define "pdserve.etcdEndpoints" -}}
{{- if .Values.etcd.endpoints -}}
{{- join "," .Values.etcd.endpoints -}}
{{- else -}}
{{- printf "%s:2379" (include "pdserve.etcdName" .) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.rayAddress" -}}
{{- printf "%s:%d" (include "pdserve.rayHeadName" .) (int .Values.ray.port) -}}
{{- end -}}

{{- define "pdserve.gracePeriod" -}}
{{- add .Values.drain.timeoutSeconds .Values.drain.graceMarginSeconds -}}
{{- end -}}

{{/*
The topology file of one role's pods: call with (dict "ctx" $ "role" "prefill"). The two
roles' files differ only in network.ucx (ucx.common, then the role's own ucx).
Relative paths resolve against the file's directory (/etc/pdserve/topology).
*/}}
{{- define "pdserve.topology" -}}
{{- $v := .ctx.Values -}}
{{- $ucx := merge (deepCopy (index $v .role "ucx")) (deepCopy $v.ucx.common) -}}
cluster: {{ include "pdserve.cluster" .ctx }}
model:
  path: {{ $v.model.path | quote }}
  name: {{ $v.model.name | quote }}
  {{- if eq $v.model.path "auto" }}
  cache_dir: /var/cache/pdserve/models
  make: {{ toJson $v.model.make }}
  {{- end }}
roles:
  prefill:
    replicas: {{ $v.prefill.replicas }}
    resources: {num_cpus: {{ $v.prefill.rayCpus }}, num_gpus: {{ $v.prefill.gpus }}}
    engine: {{ toJson $v.prefill.engine }}
    ports: {metrics: {{ $v.prefill.ports.metrics }}}
  decode:
    replicas: {{ $v.decode.replicas }}
    resources: {num_cpus: {{ $v.decode.rayCpus }}, num_gpus: {{ $v.decode.gpus }}}
    engine: {{ toJson $v.decode.engine }}
    ports: {grpc: {{ $v.decode.ports.grpc }}, http: {{ $v.decode.ports.http }}}
    remote_timeout_s: {{ $v.decode.remoteTimeoutSeconds }}
    remote_quarantine_s: {{ $v.decode.remoteQuarantineSeconds }}
router_policy: ../policies/router.yaml
autoscale_policy: {{ if $v.policies.autoscale }}../policies/autoscale.yaml{{ else }}null{{ end }}
etcd:
  endpoints: {{ toJson (splitList "," (include "pdserve.etcdEndpoints" .ctx)) }}
  lease_ttl_s: {{ $v.topology.leaseTtlSeconds }}
ray:
  address: {{ include "pdserve.rayAddress" .ctx | quote }}
  namespace: {{ $v.topology.rayNamespace | quote }}
queue:
  capacity: {{ $v.topology.queue.capacity }}
  batch_max_tokens: {{ $v.topology.queue.batchMaxTokens }}
  poll_timeout_ms: {{ $v.topology.queue.pollTimeoutMs }}
  wire: node
network:
  bind: node
  ucx: {{ toJson $ucx }}
{{- end -}}
