{{- define "ambpf.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ambpf.labels" -}}
app.kubernetes.io/name: ambpf
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ambpf.selectorLabels" -}}
app.kubernetes.io/name: ambpf
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
