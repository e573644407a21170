{{- define "pagoda.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagoda.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs, nothing more. */}}
{{- define "pagoda.rules" -}}
- apiGroups: [pagoda.dev]
  resources: [llmdeployments]
  verbs: [get, list, watch]
- apiGroups: [pagoda.dev]
  resources: [llmdeployments/status]
  verbs: [get, patch]
# Children carry ownerReferences with blockOwnerDeletion, which needs this.
- apiGroups: [pagoda.dev]
  resources: [llmdeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
# delete: the router's Service X-router when spec.router is turned off
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, delete]
# Models from the Hub: the cache claim, and the download Job (created and replaced, never patched:
# its pod template is immutable). The Job's failed pod is read through the pods list above.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
{{- if .Values.rbac.readApiKeySecrets }}
# spec.adapters with a runtime that requires an API key from a Secret (env PAGODA_API_KEY, secretKeyRef):
# the operator reads that key to call the runtime's load/unload adapter endpoints.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# create: the operator's Events on LLMDeployments; list: the StatefulSet controller's FailedCreate
# Events (ResourceQuota, Pod Security admission), read into the status.
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
# spec.autoscaling: a KEDA ScaledObject, or an HPA without KEDA (named as the LLMDeployment: no list).
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
# spec.scheduling.gang volcano: a PodGroup per group (listed to remove those of removed groups).
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, list, create, patch, delete]
# spec.router: the router's Deployment, its ServiceAccount, and a Role + RoleBinding letting it read the
# namespace's EndpointSlices. Kubernetes lets the operator grant only what it holds itself, hence the
# endpointslices read below (the operator never reads them otherwise).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# The Gateway API Inference Extension's InferencePool X, when that API is served.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch]
{{- end -}}
