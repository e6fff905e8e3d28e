{{/* Names and labels, in the usual Helm shape. */}}
{{- define "gpuq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuq.fullname" -}}
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

{{- define "gpuq.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpuq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuq
{{- end }}

{{/* Selector labels of one service's pods: (dict "root" $ "service" "admission"). */}}
{{- define "gpuq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuq.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .service }}
{{- end }}

{{/* The Deployments of one service, (dict "root" $ "service" "admission"), as a JSON list of {name, shard, cohorts,
replicas, resources}: one, or for admission with services.admission.shards one per shard, `admission-<shard>`, serving
its cohorts (GPUQ_ADMISSION_COHORTS; docs/admission.md, "Running several admission instances"). */}}
{{- define "gpuq.instances" -}}
{{- $svc := index .root.Values.services .service }}
{{- $out := list }}
{{- if and (eq .service "admission") $svc.shards }}
{{- include "gpuq.checkAdmissionShards" .root }}
{{- range $svc.shards }}
{{- $out = append $out (dict "name" (printf "admission-%s" .name) "shard" .name "cohorts" (join "," .cohorts) "replicas" (.replicas | default $svc.replicas) "resources" (.resources | default $svc.resources)) }}
{{- end }}
{{- else }}
{{- $out = append $out (dict "name" .service "shard" "" "cohorts" "" "replicas" $svc.replicas "resources" $svc.resources) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Admission's shards against config.queues: each serves whole cohort trees by their root cohort (or `-`, the
queues without a cohort and the unknown ones), no cohort in two shards (an instance would wait for it as a standby, and
its other cohorts with it), every root and `-` served (else their jobs wait unjudged). */}}
{{- define "gpuq.checkAdmissionShards" -}}
{{- $roots := list "-" }}
{{- range (.Values.config.queues.cohorts | default list) }}{{ if not .parent }}{{ $roots = append $roots .name }}{{ end }}{{ end }}
{{- $served := dict }}
{{- $names := dict }}
{{- range .Values.services.admission.shards }}
{{- $shard := .name }}
{{- if hasKey $names $shard }}{{ fail (printf "services.admission.shards: two shards are named %s" $shard) }}{{ end }}
{{- $_ := set $names $shard true }}
{{- range .cohorts }}
{{- if not (has . $roots) }}{{ fail (printf "services.admission.shards[%s]: %s is neither a root cohort of config.queues nor - (the queues without a cohort): a shard serves whole cohort trees, named by their root (here: %s)" $shard . (join ", " $roots)) }}{{ end }}
{{- if hasKey $served . }}{{ fail (printf "services.admission.shards: cohort %s is in shards %s and %s: the second would wait for it as a standby, and its other cohorts with it" . (get $served .) $shard) }}{{ end }}
{{- $_ := set $served . $shard }}
{{- end }}
{{- end }}
{{- range $roots }}{{ if not (hasKey $served .) }}{{ fail (printf "services.admission.shards: no shard serves %s, whose jobs would wait unjudged: add it to one (%s)" . (ternary "the queues without a cohort, and unknown queues' rejections" "a root cohort of config.queues" (eq . "-"))) }}{{ end }}{{ end }}
{{- end }}

{{/* Selector labels of one Deployment's pods: the service's, and its admission shard's when it has one.
(dict "root" $ "service" "admission" "shard" "research") */}}
{{- define "gpuq.instanceSelectorLabels" -}}
{{ include "gpuq.selectorLabels" . }}
{{- if .shard }}
gpuq.io/admission-shard: {{ .shard }}
{{- end }}
{{- end }}

{{- define "gpuq.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{- define "gpuq.executorServiceAccount" -}}
{{- default (printf "%s-executor" (include "gpuq.fullname" .)) .Values.serviceAccount.name }}
{{- end }}

{{/* Whether the executor is the Kubernetes one (RBAC, service account, the `kube` bus user). */}}
{{- define "gpuq.kubeExecutor" -}}
{{- if and .Values.services.executor.enabled (eq (.Values.services.executor.kind | default "kube") "kube") }}true{{ end }}
{{- end }}

{{/* The namespaces gpuq manages, where the executor may change workloads and pods (a RoleBinding in each): those
queues.yaml maps to teams (`config.queues.namespaces`) and `rbac.managedNamespaces`, sorted, as a JSON list. */}}
{{- define "gpuq.managedNamespaces" -}}
{{- $names := list }}
{{- range (.Values.config.queues.namespaces | default list) }}{{ $names = append $names .name }}{{ end }}
{{- range (.Values.rbac.managedNamespaces | default list) }}{{ $names = append $names . }}{{ end }}
{{- $names | uniq | sortAlpha | toJson }}
{{- end }}

{{/* Whether the API verifies Kubernetes tokens (TokenReview): its own service account, token and ClusterRole. */}}
{{- define "gpuq.apiTokenReview" -}}
{{- if and .Values.services.api.enabled .Values.services.api.tokenReview.enabled }}true{{ end }}
{{- end }}

{{- define "gpuq.apiServiceAccount" -}}
{{- printf "%s-api" (include "gpuq.fullname" .) }}
{{- end }}

{{/* The bus user a service connects as (shared/natsauth.py): its own name, except the Kubernetes executor, which
is also the intake of workloads and connects as `kube`. (dict "root" $ "service" "executor") */}}
{{- define "gpuq.busUser" -}}
{{- if and (eq .service "executor") (include "gpuq.kubeExecutor" .root) }}kube{{ else }}{{ .service }}{{ end }}
{{- end }}

{{/* NATS_URL of one service: with natsAuth (the default), its own bus user's Secret (`gpuq nats-auth --kube-secrets`
writes them); else a Secret holding the URL, or the plain external URL (in that order). Both at once is refused: an
externalNats left from before natsAuth was the default would otherwise be silently ignored.
(dict "root" $ "service" "admission") */}}
{{- define "gpuq.natsEnv" -}}
{{- $v := .root.Values }}
- name: NATS_URL
{{- if $v.natsAuth.enabled }}
  {{- if or $v.externalNats.url $v.externalNats.existingSecret.name }}
  {{- fail "NATS: natsAuth.enabled is on (the default: each service reads its own bus user's NATS_URL from the Secret <natsAuth.secretPrefix><user>, written by `gpuq nats-auth --kube-secrets`, docs/install.md) and externalNats is set too: drop externalNats, or set natsAuth.enabled=false for one URL for every service on a server without per-service users (docs/security.md says what that leaves open)" }}
  {{- end }}
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s%s" $v.natsAuth.secretPrefix (include "gpuq.busUser" .) }}
      key: {{ $v.natsAuth.key }}
{{- else if $v.externalNats.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.externalNats.existingSecret.name }}
      key: {{ $v.externalNats.existingSecret.key }}
{{- else if $v.externalNats.url }}
  value: {{ $v.externalNats.url | quote }}
{{- else }}
  {{- fail "NATS: set natsAuth.enabled (a bus user per service, by Secret), externalNats.url, or externalNats.existingSecret.name (a Secret holding the URL with credentials)" }}
{{- end }}
{{- end }}

{{/* How many NATS servers keep a copy of each stream (GPUQ_STREAM_REPLICAS): streams.replicas, or 3 on a clustered
NATS, else 1. */}}
{{- define "gpuq.streamReplicas" -}}
{{- $s := .Values.streams }}
{{- $asked := int ($s.replicas | default 0) }}
{{- if and (gt $asked 1) (not $s.natsClustered) }}
{{- fail (printf "streams.replicas=%d needs a NATS cluster: set streams.natsClustered=true (a JetStream cluster of 3 servers or more), or streams.replicas=1 for a single server" $asked) }}
{{- end }}
{{- if gt $asked 0 }}{{ $asked }}{{ else if $s.natsClustered }}3{{ else }}1{{ end }}
{{- end }}

{{/* The services that keep webhook signing secrets, encrypted with the secrets key (shared/secretbox.py). */}}
{{- define "gpuq.needsSecretsKey" -}}
{{- if or (eq . "api") (eq . "telemetry") }}true{{ end }}
{{- end }}

{{/* DATABASE_URL from the Secret externalDatabase names (with CloudNativePG: its Cluster's `<cluster>-app`). */}}
{{- define "gpuq.databaseEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
{{- if .Values.externalDatabase.existingSecret.name }}
      name: {{ .Values.externalDatabase.existingSecret.name }}
      key: {{ .Values.externalDatabase.existingSecret.key }}
{{- else }}
  {{- fail "Postgres: set externalDatabase.existingSecret.name (a Secret holding DATABASE_URL)" }}
{{- end }}
{{- end }}

{{/* Whether the executor serves the admission webhook (the Kubernetes executor, webhook.enabled, a managed
namespace to guard). */}}
{{- define "gpuq.webhook" -}}
{{- if and .Values.webhook.enabled (include "gpuq.kubeExecutor" .) (include "gpuq.managedNamespaces" . | fromJsonArray) }}true{{ end }}
{{- end }}
