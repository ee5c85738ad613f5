{{/* The release's full name, at most 63 characters. */}}
{{- define "disagg-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "disagg-operator.labels" -}}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: disagg-serving
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "disagg-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs on namespaced objects: nothing more. */}}
{{- define "disagg-operator.namespacedRules" -}}
- apiGroups: ["serving.disagg.dev"]
  resources: ["disaggservings"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.disagg.dev"]
  resources: ["disaggservings/status"]
  verbs: ["get", "patch"]
# Server-side apply creates through PATCH, which needs create as well.
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Instances spanning nodes (nodesPerInstance > 1), where the LeaderWorkerSet CRD is installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Pods only listed: their container states say why an instance keeps failing.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# Events: its own are created; the kubelet's FailedMount ones are listed, as they alone say
# which Secret a waiting pod lacks (the operator has no access to Secrets).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
{{- end -}}
