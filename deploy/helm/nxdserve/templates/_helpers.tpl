{{- define "nxdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "nxdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "nxdserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "nxdserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nxdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nxdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nxdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "nxdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The grace period covers the preStop sleep, the server's drain and a margin for its exit. */}}
{{- define "nxdserve.terminationGrace" -}}
{{- add .Values.preStopSleepSeconds .Values.server.drainTimeoutSeconds .Values.terminationGraceMarginSeconds -}}
{{- end -}}

{{- define "nxdserve.cacheClaim" -}}
{{- if .Values.compileCache.existingClaim -}}
{{- .Values.compileCache.existingClaim -}}
{{- else -}}
{{- printf "%s-compile-cache" (include "nxdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The PromQL both autoscalers use: waiting requests summed over this release's pods. */}}
{{- define "nxdserve.waitingQuery" -}}
sum(vllm:num_requests_waiting{namespace="{{ .Release.Namespace }}",service="{{ include "nxdserve.fullname" . }}"})
{{- end -}}
