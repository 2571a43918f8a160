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
  {{- include "pdserve.etcdTls" .ctx }}
ray:
  address: {{ include "pdserve.rayAddress" .ctx | quote }}
  namespace: {{ $v.topology.rayNamespace | quote }}
  {{- if $v.ray.auth.tokenSecretName }}
  auth: token
  token_file: ../ray/token
  {{- end }}
queue:
  capacity: {{ $v.topology.queue.capacity }}
  batch_max_tokens: {{ $v.topology.queue.batchMaxTokens }}
  poll_timeout_ms: {{ $v.topology.queue.pollTimeoutMs }}
  wire: node
  {{- if $v.security.queue.secretName }}
  # The wire advertises the Ray head pod's IP: its certificate names the head's Service instead.
  tls:
    cert: ../queue/tls.crt
    key: ../queue/tls.key
    ca: ../queue/ca.crt
    server_name: {{ include "pdserve.rayHeadName" .ctx }}
    {{- if $v.security.queue.mutual }}
    client_ca: ../queue/ca.crt
    client_cert: ../queue/client.crt
    client_key: ../queue/client.key
    {{- end }}
  {{- end }}
network:
  bind: node
  ucx: {{ toJson $ucx }}
{{- if or $v.security.tls.secretName $v.security.apiKeys.secretName }}
security:
  {{- if $v.security.tls.secretName }}
  tls:
    cert: ../tls/tls.crt
    key: ../tls/tls.key
    {{- if $v.security.tls.mutual }}
    client_ca: ../tls/ca.crt
    {{- end }}
  {{- end }}
  {{- if $v.security.apiKeys.secretName }}
  api_keys: {file: ../api-keys/keys.txt}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
etcd.tls of a topology (security.etcd.secretName: the workers' client certificates); with
"root" true, the root identity too (etcd.tls.rootSecretName: the RBAC bootstrap Job).
*/}}
{{- define "pdserve.etcdTls" -}}
{{- $v := .Values -}}
{{- if $v.security.etcd.secretName }}
  tls:
    ca: ../etcd/ca.crt
    worker: {cert: ../etcd/worker.crt, key: ../etcd/worker.key}
    {{- if $v.security.etcd.operator }}
    operator: {cert: ../etcd/operator.crt, key: ../etcd/operator.key}
    {{- end }}
{{- end }}
{{- end -}}

{{/*
The topology `pdserve etcd-auth` reads in the RBAC bootstrap Job: the cluster, its replicas and
etcd with the root identity added (the files the Job mounts), nothing else.
*/}}
{{- define "pdserve.etcdAuthTopology" -}}
{{- $v := .Values -}}
cluster: {{ include "pdserve.cluster" . }}
model: {path: {{ $v.model.path | quote }}}
roles:
  prefill: {replicas: {{ $v.prefill.replicas }}}
  decode: {replicas: {{ $v.decode.replicas }}}
etcd:
  endpoints: {{ toJson (splitList "," (include "pdserve.etcdEndpoints" .)) }}
  {{- include "pdserve.etcdTls" . }}
    root: {cert: ../etcd-root/root.crt, key: ../etcd-root/root.key}
{{- end -}}

{{/*
The Secrets (values `security.*`, `ray.auth`) a pod mounts, as volumes and volumeMounts:
call with (dict "ctx" $ "rayOnly" true) for the Ray head, which needs only Ray's token and
the queue's certificate (the prefill queue actor runs on the head).
Each Secret's keys are listed (`items`), so a missing key fails the pod's start naming it.
The topology above names them relative to its own directory (/etc/pdserve/topology).
*/}}
{{- define "pdserve.secretVolumes" -}}
{{- $s := .ctx.Values.security -}}
{{- with .ctx.Values.ray.auth.tokenSecretName }}
- name: ray-token
  secret: {secretName: {{ . }}, defaultMode: 0400, items: [{key: token, path: token}]}
{{- end }}
{{- with $s.queue.secretName }}
- name: queue-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0400
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- if $s.queue.mutual }}
      - {key: client.crt, path: client.crt}
      - {key: client.key, path: client.key}
      {{- end }}
{{- end }}
{{- if not .rayOnly }}
{{- with $s.tls.secretName }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0400
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- if $s.tls.mutual }}
      - {key: ca.crt, path: ca.crt}
      {{- end }}
{{- end }}
{{- with $s.apiKeys.secretName }}
- name: api-keys
  secret: {secretName: {{ . }}, defaultMode: 0400, items: [{key: keys.txt, path: keys.txt}]}
{{- end }}
{{- with $s.etcd.secretName }}
- name: etcd-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0400
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: worker.crt, path: worker.crt}
      - {key: worker.key, path: worker.key}
      {{- if $s.etcd.operator }}
      - {key: operator.crt, path: operator.crt}
      - {key: operator.key, path: operator.key}
      {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.secretMounts" -}}
{{- $s := .ctx.Values.security -}}
{{- if .ctx.Values.ray.auth.tokenSecretName }}
- {name: ray-token, mountPath: /etc/pdserve/ray, readOnly: true}
{{- end }}
{{- if $s.queue.secretName }}
- {name: queue-tls, mountPath: /etc/pdserve/queue, readOnly: true}
{{- end }}
{{- if not .rayOnly }}
{{- if $s.tls.secretName }}
- {name: tls, mountPath: /etc/pdserve/tls, readOnly: true}
{{- end }}
{{- if $s.apiKeys.secretName }}
- {name: api-keys, mountPath: /etc/pdserve/api-keys, readOnly: true}
{{- end }}
{{- if $s.etcd.secretName }}
- {name: etcd-tls, mountPath: /etc/pdserve/etcd, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{/* Env of every Ray process (head, and the worker pods' `ray start`): Ray's authentication
from ray.auth, then ray.env. */}}
{{- define "pdserve.rayEnv" -}}
{{- if .Values.ray.auth.tokenSecretName }}
- {name: RAY_AUTH_MODE, value: token}
- {name: RAY_AUTH_TOKEN_PATH, value: /etc/pdserve/ray/token}
{{- else }}
- {name: RAY_AUTH_MODE, value: disabled}
{{- end }}
{{- range $k, $v := .Values.ray.env }}
- {name: {{ $k }}, value: {{ $v | quote }}}
{{- end }}
{{- end -}}

{{/*
How the kubelet checks a decode worker's health, by security.tls: plaintext: the gRPC
health service (`grpc`) or GET /health; TLS: GET /health over HTTPS (the kubelet does not
verify the certificate); mutual TLS: the kubelet cannot present a client certificate, so an
exec probe (cluster/health_probe.py) GETs /health presenting the workers' own certificate.
Call with (dict "ctx" $ "grpc" true) for the startup and readiness probes.
*/}}
{{- define "pdserve.decodeHealthProbe" -}}
{{- $v := .ctx.Values -}}
{{- if not $v.security.tls.secretName -}}
{{- if .grpc -}}
grpc: {port: {{ $v.decode.ports.grpc }}}
{{- else -}}
httpGet: {path: /health, port: http}
{{- end -}}
{{- else if not $v.security.tls.mutual -}}
httpGet: {path: /health, port: http, scheme: HTTPS}
{{- else -}}
exec:
  command: ["python3", "-m", "pdserve.cluster.health_probe", "https://127.0.0.1:{{ $v.decode.ports.http }}/health", "--cert", "/etc/pdserve/tls/tls.crt", "--key", "/etc/pdserve/tls/tls.key"]
{{- end -}}
{{- end -}}
