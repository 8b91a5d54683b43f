{{/*
Standard helpers, as dcgm-exporter's chart has them: name, fullname, chart, labels, selectorLabels.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "volga.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: fullnameOverride, else "<release>-<name>", else the release name alone when it already contains
the chart name. Truncated to 63 characters (DNS label limit); component suffixes stay within it.
*/}}
{{- define "volga.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "volga.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "volga.labels" -}}
helm.sh/chart: {{ include "volga.chart" . }}
{{ include "volga.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: volga
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select this release's pods (a component label narrows them further). */}}
{{- define "volga.selectorLabels" -}}
app.kubernetes.io/name: {{ include "volga.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Names of the operator's and the agent's objects. */}}
{{- define "volga.operator.fullname" -}}
{{- printf "%s-operator" (include "volga.fullname" .) }}
{{- end }}

{{- define "volga.agent.fullname" -}}
{{- printf "%s-agent" (include "volga.fullname" .) }}
{{- end }}

{{- define "volga.gateway.fullname" -}}
{{- printf "%s-gateway" (include "volga.fullname" .) }}
{{- end }}

{{- define "volga.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "volga.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "volga.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "volga.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- required "agent.serviceAccount.name is required when agent.serviceAccount.create is false" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion. Call with an image values block + root. */}}
{{- define "volga.image" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/* Name of the snapshot claim: the existing one, or the one the chart creates. */}}
{{- define "volga.snapshotClaimName" -}}
{{- default (printf "%s-snapshots" (include "volga.fullname" .)) .Values.agent.snapshots.persistentVolumeClaim.existingClaim }}
{{- end }}

{{/* The Secret of the Agent API's tokens (agent.neighbours): the user's, or the one the chart creates. */}}
{{- define "volga.agent.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "volga.agent.fullname" .)) .Values.agent.neighbours.auth.existingSecret }}
{{- end }}

{{/*
Fails on values that cannot work together: the neighbour exchange trades the autonomy loop's water level, and is
turned on by agent.neighbours (which also opens the Agent API to the other agents), not by the setting alone.
*/}}
{{- define "volga.validate" -}}
{{- $settings := .Values.agent.settings }}
{{- if and .Values.agent.neighbours.enabled (not $settings.autonomy_enabled) }}
{{- fail "agent.neighbours.enabled needs agent.settings.autonomy_enabled: true (neighbours trade the autonomy loop's water level; docs/architecture.md, Neighbours)" }}
{{- end }}
{{- if and (or $settings.neighbours_enabled $settings.neighboursEnabled) (not .Values.agent.neighbours.enabled) }}
{{- fail "agent.settings.neighbours_enabled: set agent.neighbours.enabled instead (it also gives the Agent API its tokens, port and published address)" }}
{{- end }}
{{- if eq (clean .Values.agent.workdir) "/run" }}
{{- fail "agent.workdir: /run is the agent's own tmpfs (CRIU's kernel-probe cache); give the workdir a folder below it, such as /run/volga" }}
{{- end }}
{{- end }}
