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

{{- define "pdserve.control" -}}
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

{{- /* The image deploy/docker builds: <repository>:<tag> (Dockerfile, CPU) or
<repository>:<tag>-gpu (Dockerfile.gpu); variant auto picks -gpu when a role asks for GPUs. */ -}}
{{- define "pdserve.image" -}}
{{- $variant := .Values.image.variant | default "auto" -}}
{{- if eq $variant "auto" -}}
{{- $variant = ternary "gpu" "cpu" (or (gt (int .Values.prefill.gpus) 0) (gt (int .Values.decode.gpus) 0)) -}}
{{- end -}}
{{- printf "%s:%s%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) (ternary "-gpu" "" (eq $variant "gpu")) -}}
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

{{/*
The etcd gate (etcd.gate.enabled, etcd-gate.yaml): its Service name, its endpoint, and the
endpoints the workers, the gateway and the KV index use: the gate's when it is on (their etcd
users then have no grants in etcd itself), else etcd's. The operator side (the preStop drain,
the RBAC Job) keeps etcd's: the gate does not serve the operator.
*/}}
{{- define "pdserve.etcdGateName" -}}{{ include "pdserve.fullname" . }}-etcd-gate{{- end -}}

{{- define "pdserve.etcdGateEndpoint" -}}
{{- printf "%s:%d" (include "pdserve.etcdGateName" .) (int .Values.etcd.gate.port) -}}
{{- end -}}

{{- define "pdserve.clientEtcdEndpoints" -}}
{{- if .Values.etcd.gate.enabled -}}
{{- include "pdserve.etcdGateEndpoint" . -}}
{{- else -}}
{{- include "pdserve.etcdEndpoints" . -}}
{{- end -}}
{{- end -}}

{{/* The gate's --workers: ROLE:WORKER_ID of every worker slot with an identity of its own
(none with security.etcd.sharedWorkerIdentity: the gate serves the shared `worker` then). */}}
{{- define "pdserve.etcdGateWorkers" -}}
{{- $ids := list -}}
{{- if include "pdserve.perWorkerEtcd" . -}}
{{- range $role := list "prefill" "decode" -}}
{{- range $i := until (int (include "pdserve.workerSlots" (dict "ctx" $ "role" $role))) -}}
{{- $ids = append $ids (printf "%s:%s-%d" $role $role $i) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- join "," $ids -}}
{{- end -}}

{{/* The Secret with the gate's server certificate: etcd.gate.secretName, else etcd.tls.secretName's. */}}
{{- define "pdserve.etcdGateSecret" -}}
{{- default .Values.etcd.tls.secretName .Values.etcd.gate.secretName -}}
{{- end -}}

{{/*
The topology the gate reads (`python -m pdserve.cluster.etcd_gate --topology`): the cluster, and
etcd with the CA, the gate's own server certificate and the operator identity it acts as.
*/}}
{{- define "pdserve.etcdGateTopology" -}}
{{- $v := .Values -}}
cluster: {{ include "pdserve.control" . }}
model: {path: {{ $v.model.path | quote }}}
roles:
  prefill: {replicas: {{ $v.prefill.replicas }}}
  decode: {replicas: {{ $v.decode.replicas }}}
etcd:
  endpoints: {{ toJson (splitList "," (include "pdserve.etcdEndpoints" .)) }}
  tls:
    ca: ../etcd/ca.crt
    server: {cert: ../etcd-gate-tls/tls.crt, key: ../etcd-gate-tls/tls.key}
    operator: {cert: ../etcd/operator.crt, key: ../etcd/operator.key}
{{- end -}}

{{- define "pdserve.rayAddress" -}}
{{- printf "%s:%d" (include "pdserve.rayHeadName" .) (int .Values.ray.port) -}}
{{- end -}}

{{- define "pdserve.gracePeriod" -}}
{{- add .Values.drain.timeoutSeconds .Values.drain.graceMarginSeconds -}}
{{- end -}}

{{/*
The topology file of one role's pods: call with (dict "ctx" $ "role" "prefill"). The two
roles' files differ only in network.ucx (ucx.common, then the role's own ucx). Role
"gateway": the decode workers' file as the gateway pods need it (gateway.yaml): etcd as the
read-only reader identity, the workers' CA and service name, the operator key it calls them
with; no Ray token or queue certificates (it uses neither). Role "kv-index" (kv-index.yaml):
etcd as reader, nothing else of security (the index calls no worker API). With
kvIndex.enabled both roles' engines publish KV events unless their engine args say otherwise.
Relative paths resolve against the file's directory (/etc/pdserve/topology).
*/}}
{{- define "pdserve.topology" -}}
{{- $v := .ctx.Values -}}
{{- $gw := eq .role "gateway" -}}
{{- $index := eq .role "kv-index" -}}
{{- $follower := or $gw $index -}}
{{- $ucx := merge (deepCopy (index $v (ternary "decode" .role $follower) "ucx")) (deepCopy $v.ucx.common) -}}
cluster: {{ include "pdserve.control" .ctx }}
model:
  path: {{ $v.model.path | quote }}
  name: {{ $v.model.name | quote }}
  {{- if eq $v.model.path "auto" }}
  cache_dir: /var/cache/pdserve/models
  make: {{ toJson $v.model.make }}
  {{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $r := index $v $role }}
{{- if and (gt (int $r.gpus) 0) (lt (int $r.gpus) (int ($r.tensorParallelSize | default 1))) }}
{{- fail (printf "%s.gpus=%v but %s.tensorParallelSize=%v: each rank of a worker holds a GPU; set %s.gpus to at least %v" $role $r.gpus $role $r.tensorParallelSize $role $r.tensorParallelSize) }}
{{- end }}
{{- end }}
roles:
  prefill:
    replicas: {{ $v.prefill.replicas }}
    tensor_parallel_size: {{ $v.prefill.tensorParallelSize | default 1 }}
    resources: {num_cpus: {{ $v.prefill.rayCpus }}, num_gpus: {{ $v.prefill.gpus }}}
    engine: {{ include "pdserve.engineArgs" (dict "ctx" .ctx "role" "prefill") }}
    ports: {metrics: {{ $v.prefill.ports.metrics }}}
  decode:
    replicas: {{ $v.decode.replicas }}
    tensor_parallel_size: {{ $v.decode.tensorParallelSize | default 1 }}
    resources: {num_cpus: {{ $v.decode.rayCpus }}, num_gpus: {{ $v.decode.gpus }}}
    engine: {{ include "pdserve.engineArgs" (dict "ctx" .ctx "role" "decode") }}
    ports: {grpc: {{ $v.decode.ports.grpc }}, http: {{ $v.decode.ports.http }}}
    remote_timeout_s: {{ $v.decode.remoteTimeoutSeconds }}
    remote_quarantine_s: {{ $v.decode.remoteQuarantineSeconds }}
router_policy: ../policies/router.yaml
autoscale_policy: {{ if $v.policies.autoscale }}../policies/autoscale.yaml{{ else }}null{{ end }}
etcd:
  endpoints: {{ toJson (splitList "," (include "pdserve.etcdEndpoints" .ctx)) }}
  lease_ttl_s: {{ $v.topology.leaseTtlSeconds }}
  {{- if not $follower }}
  {{- include "pdserve.etcdTls" .ctx }}
  {{- else if $v.security.etcd.secretName }}
  tls:
    ca: ../etcd/ca.crt
    reader: {cert: ../etcd/reader.crt, key: ../etcd/reader.key}
  {{- end }}
ray:
  address: {{ include "pdserve.rayAddress" .ctx | quote }}
  namespace: {{ $v.topology.rayNamespace | quote }}
  {{- if and $v.ray.auth.tokenSecretName (not $follower) }}{{/* the gateway and the index run no Ray */}}
  auth: token
  token_file: ../ray/token
  {{- end }}
queue:
  capacity: {{ $v.topology.queue.capacity }}
  batch_max_tokens: {{ $v.topology.queue.batchMaxTokens }}
  poll_timeout_ms: {{ $v.topology.queue.pollTimeoutMs }}
  stall_timeout_s: {{ $v.topology.queue.stallTimeoutSeconds }}
  wire: node
  {{- if and $v.security.queue.secretName (not $follower) }}
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
{{- if and (or $v.security.tls.secretName $v.security.apiKeys.secretName) (not $index) }}
security:
  {{- if $v.security.tls.secretName }}
  tls:
    cert: ../tls/tls.crt
    key: ../tls/tls.key
    {{- if $v.security.tls.mutual }}
    client_ca: ../tls/ca.crt
    {{- end }}
    {{- if $gw }}
    ca: ../tls/ca.crt
    server_name: {{ include "pdserve.workerServerName" .ctx }}
    {{- end }}
  {{- end }}
  {{- if $v.security.apiKeys.secretName }}
  api_keys: {file: ../api-keys/keys.txt}
  {{- end }}
{{- end }}
{{- if and $gw $v.security.apiKeys.secretName }}
gateway:
  worker_api_key_file: ../gateway-key/api-key
{{- end }}
{{- end -}}

{{/* A role's engine args as JSON: <role>.engine, with kv_events on when kvIndex.enabled and
the args do not set it. Call with (dict "ctx" $ "role" "decode"). */}}
{{- define "pdserve.engineArgs" -}}
{{- $eng := deepCopy (index .ctx.Values .role "engine") -}}
{{- if and .ctx.Values.kvIndex.enabled (not (hasKey $eng "kv_events")) -}}
{{- $_ := set $eng "kv_events" true -}}
{{- end -}}
{{- toJson $eng -}}
{{- end -}}

{{/* The name the decode workers' TLS certificate carries (what the gateway checks it for). */}}
{{- define "pdserve.workerServerName" -}}
{{- default (printf "%s-decode.%s.svc" (include "pdserve.fullname" .) .Release.Namespace) .Values.security.tls.serverName -}}
{{- end -}}

{{/*
etcd.tls of a topology (security.etcd.secretName: the workers' client certificates); with
"root" true, the root identity too (etcd.tls.rootSecretName: the RBAC bootstrap Job). The
workers connect as their own identity (etcd.tls.workers: each pod's init container puts its
<worker_id>.pem there, pdserve.etcdIdentityInit) unless security.etcd.sharedWorkerIdentity.
*/}}
{{- define "pdserve.etcdTls" -}}
{{- $v := .Values -}}
{{- if $v.security.etcd.secretName }}
  tls:
    ca: ../etcd/ca.crt
    {{- if $v.security.etcd.sharedWorkerIdentity }}
    worker: {cert: ../etcd/worker.crt, key: ../etcd/worker.key}
    {{- else }}
    workers:
      dir: ../etcd-worker
      slots: {prefill: {{ include "pdserve.workerSlots" (dict "ctx" . "role" "prefill") }}, decode: {{ include "pdserve.workerSlots" (dict "ctx" . "role" "decode") }}}
    {{- end }}
    {{- if $v.security.etcd.operator }}
    operator: {cert: ../etcd/operator.crt, key: ../etcd/operator.key}
    {{- end }}
{{- end }}
{{- end -}}

{{/* "true" when each worker pod connects to etcd as its own identity (the default with etcd TLS). */}}
{{- define "pdserve.perWorkerEtcd" -}}
{{- if and .Values.security.etcd.secretName (not .Values.security.etcd.sharedWorkerIdentity) -}}true{{- end -}}
{{- end -}}

{{/*
How many worker ids of a role (<role>-0 .. <role>-N-1) get an etcd identity of their own:
security.etcd.workers.slots.<role>, else the larger of <role>.replicas and the autoscale
policy's max_replicas (its defaults: prefill 12, decode 24), as `etcd.tls.workers.slots`
defaults in a topology. Call with (dict "ctx" $ "role" "decode").
*/}}
{{- define "pdserve.workerSlots" -}}
{{- $v := .ctx.Values -}}
{{- $set := $v.security.etcd.workers.slots -}}
{{- if hasKey $set .role -}}
{{- int (index $set .role) -}}
{{- else -}}
{{- $n := int (index $v .role).replicas -}}
{{- if $v.policies.autoscale -}}
{{- $n = max $n (int (dig "autoscale" .role "max_replicas" (ternary 12 24 (eq .role "prefill")) $v.policies.autoscale)) -}}
{{- end -}}
{{- $n -}}
{{- end -}}
{{- end -}}

{{/* The items of the etcd client Secret (security.etcd.secretName) that the topology names. */}}
{{- define "pdserve.etcdClientItems" -}}
{{- $e := .Values.security.etcd -}}
- {key: ca.crt, path: ca.crt}
{{- if $e.sharedWorkerIdentity }}
- {key: worker.crt, path: worker.crt}
- {key: worker.key, path: worker.key}
{{- end }}
{{- if $e.operator }}
- {key: operator.crt, path: operator.crt}
- {key: operator.key, path: operator.key}
{{- end }}
{{- end -}}

{{/*
A worker pod's own etcd identity (pdserve.perWorkerEtcd): an init container that copies the
certificate of worker <role>-<ordinal> out of the role's slots in the workers' Secret into a
memory volume, the only one the worker container mounts. Call with (dict "ctx" $ "role" "decode")
for the init container; "pdserve.etcdIdentityVolumes" gives its two volumes.
*/}}
{{- define "pdserve.etcdIdentityInit" -}}
{{- $v := .ctx.Values -}}
{{- $slots := int (include "pdserve.workerSlots" .) -}}
- name: etcd-identity
  image: {{ include "pdserve.image" .ctx }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["/bin/sh", "-ec"]
  args:
    - |
      id={{ .role }}-${POD_NAME##*-}
      if [ ! -f /etc/pdserve/etcd-workers/$id.pem ] || [ ! -f /etc/pdserve/etcd-workers/$id-key.pem ]; then
        echo "pod $POD_NAME: worker $id has no etcd identity: no $id.pem and $id-key.pem in the Secret {{ include "pdserve.etcdWorkersSecret" .ctx }} among the {{ $slots }} slots of {{ .role }} ({{ .role }}-0 to {{ .role }}-{{ sub $slots 1 }}, security.etcd.workers.slots.{{ .role }}): keep {{ .role }}.replicas within the slots, or raise them, and put every slot's certificate in the Secret" >&2
        exit 1
      fi
      cp /etc/pdserve/etcd-workers/$id.pem /etc/pdserve/etcd-workers/$id-key.pem /etc/pdserve/etcd-worker/
      chmod 0400 /etc/pdserve/etcd-worker/$id.pem /etc/pdserve/etcd-worker/$id-key.pem
      echo "pod $POD_NAME: etcd identity worker/{{ include "pdserve.control" .ctx }}/$id"
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
  volumeMounts:
    - {name: etcd-workers, mountPath: /etc/pdserve/etcd-workers, readOnly: true}
    - {name: etcd-worker, mountPath: /etc/pdserve/etcd-worker}
{{- end -}}

{{- define "pdserve.etcdWorkersSecret" -}}
{{- default .Values.security.etcd.secretName .Values.security.etcd.workers.secretName -}}
{{- end -}}

{{- define "pdserve.etcdIdentityVolumes" -}}
{{- $slots := int (include "pdserve.workerSlots" .) -}}
- name: etcd-workers
  secret:
    secretName: {{ include "pdserve.etcdWorkersSecret" .ctx }}
    defaultMode: 0400
    # A slot's certificate missing from the Secret stops only the pod of that slot (its init
    # container says which), not every pod of the role.
    optional: true
    items:
      {{- range $i := until $slots }}
      - {key: {{ $.role }}-{{ $i }}.pem, path: {{ $.role }}-{{ $i }}.pem}
      - {key: {{ $.role }}-{{ $i }}-key.pem, path: {{ $.role }}-{{ $i }}-key.pem}
      {{- end }}
- name: etcd-worker
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end -}}

{{/*
The topology `pdserve etcd-auth` reads in the RBAC bootstrap Job: the cluster, its replicas and
etcd with the root identity added (the files the Job mounts), and the gate when it is on (the
bootstrap is then gated), nothing else.
*/}}
{{- define "pdserve.etcdAuthTopology" -}}
{{- $v := .Values -}}
cluster: {{ include "pdserve.control" . }}
model: {path: {{ $v.model.path | quote }}}
roles:
  prefill: {replicas: {{ $v.prefill.replicas }}}
  decode: {replicas: {{ $v.decode.replicas }}}
etcd:
  endpoints: {{ toJson (splitList "," (include "pdserve.etcdEndpoints" .)) }}
  {{- if $v.etcd.gate.enabled }}
  # Gated: the workers' users and `reader` get no grants in etcd (they go through the gate).
  gate: {endpoints: [{{ include "pdserve.etcdGateEndpoint" . | quote }}]}
  {{- end }}
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
      {{- include "pdserve.etcdClientItems" $.ctx | nindent 6 }}
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
{{- if include "pdserve.perWorkerEtcd" .ctx }}
- {name: etcd-worker, mountPath: /etc/pdserve/etcd-worker, readOnly: true}
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
Call with (dict "ctx" $ "grpc" true) for the startup and readiness probes; "httpPort": the
port of another server of the same security (the gateway's).
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
  command: ["python3", "-m", "pdserve.cluster.health_probe", "https://127.0.0.1:{{ .httpPort | default $v.decode.ports.http }}/health", "--cert", "/etc/pdserve/tls/tls.crt", "--key", "/etc/pdserve/tls/tls.key"]
{{- end -}}
{{- end -}}
