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

{{/* NATS_URL: the subchart's client service, a Secret, or the plain external URL (in that order). */}}
{{- define "gpuq.natsEnv" -}}
- name: NATS_URL
{{- if .Values.nats.enabled }}
  {{- $nats := ternary .Release.Name (printf "%s-nats" .Release.Name) (contains "nats" .Release.Name) }}
  value: {{ printf "nats://%s:4222" (.Values.nats.fullnameOverride | default $nats) | quote }}
{{- else if .Values.externalNats.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.externalNats.existingSecret.name }}
      key: {{ .Values.externalNats.existingSecret.key }}
{{- else if .Values.externalNats.url }}
  value: {{ .Values.externalNats.url | quote }}
{{- else }}
  {{- fail "NATS: set externalNats.url, or externalNats.existingSecret.name (a Secret holding the URL with credentials), or nats.enabled=true" }}
{{- end }}
{{- end }}

{{/* DATABASE_URL: the CloudNativePG cluster's app Secret (key uri), or the external Secret. */}}
{{- define "gpuq.databaseEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
{{- if .Values.cnpg.enabled }}
      {{- $cnpg := ternary .Release.Name (printf "%s-cnpg" .Release.Name) (contains "cnpg" .Release.Name) }}
      name: {{ printf "%s-app" (.Values.cnpg.fullnameOverride | default $cnpg) }}
      key: uri
{{- else if .Values.externalDatabase.existingSecret.name }}
      name: {{ .Values.externalDatabase.existingSecret.name }}
      key: {{ .Values.externalDatabase.existingSecret.key }}
{{- else }}
  {{- fail "Postgres: set externalDatabase.existingSecret.name (a Secret holding DATABASE_URL), or cnpg.enabled=true" }}
{{- end }}
{{- end }}
