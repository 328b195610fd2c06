{{/* The DRA driver name: also the attribute domain and the opaque config API group. */}}
{{- define "cleave.driverName" -}}
gpu.cleave.dev
{{- end -}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "cleave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release name plus chart name unless the release name already holds it. */}}
{{- define "cleave.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* chart label value: name-version. */}}
{{- define "cleave.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the plugin pods (must never change between releases). */}}
{{- define "cleave.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cleave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{/* Labels on every object. */}}
{{- define "cleave.labels" -}}
helm.sh/chart: {{ include "cleave.chart" . }}
app.kubernetes.io/name: {{ include "cleave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cleave
{{- end -}}

{{/* ServiceAccount name. */}}
{{- define "cleave.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cleave.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference; the tag defaults to the chart's appVersion. */}}
{{- define "cleave.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Per-driver data directory on the host (checkpoint, MPS state, mock NVML state). */}}
{{- define "cleave.pluginDataDir" -}}
{{- printf "%s/plugins/%s" (trimSuffix "/" .Values.kubeletPlugin.kubeletDir) (include "cleave.driverName" .) -}}
{{- end -}}

{{/* Image of the per-claim MPS daemon pods: mps.image, each empty field taken from the
plugin's image (the daemon runs `cleave-kubelet-plugin mps-daemon` from the same build). */}}
{{- define "cleave.mpsImage" -}}
{{- $repo := default .Values.image.repository .Values.mps.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.mps.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Pull policy of the MPS daemon pods: mps.image.pullPolicy, else the plugin's. */}}
{{- define "cleave.mpsImagePullPolicy" -}}
{{- default .Values.image.pullPolicy .Values.mps.image.pullPolicy -}}
{{- end -}}

{{/* The cluster's Kubernetes version: kubernetesVersion when set, else the one Helm reports
(.Capabilities.KubeVersion: the API server's on install/upgrade, --kube-version or Helm's
default with `helm template`). */}}
{{- define "cleave.kubeVersion" -}}
{{- default .Capabilities.KubeVersion.Version .Values.kubernetesVersion -}}
{{- end -}}

{{/* "true" when the cluster's version (cleave.kubeVersion) is 1.36 or later
(DRAExtendedResource and DRADeviceTaints beta and on by default), else empty. Pre-releases
and vendor builds ("1.36.0-rc.1", "v1.36.2-eks-1a2b3c") count as 1.36. */}}
{{- define "cleave.kube136" -}}
{{- if semverCompare ">=1.36.0-0" (include "cleave.kubeVersion" .) -}}true{{- end -}}
{{- end -}}

{{/* The gpu class's extended resource: the value when set (even ""), else nvidia.com/gpu
from 1.36. */}}
{{- define "cleave.gpuExtendedResourceName" -}}
{{- $v := .Values.deviceClasses.gpu.extendedResourceName -}}
{{- if kindIs "invalid" $v -}}
{{- if include "cleave.kube136" . -}}nvidia.com/gpu{{- end -}}
{{- else -}}
{{- $v -}}
{{- end -}}
{{- end -}}

{{/* --device-taints: the value when set, else "on" from 1.36 and "off" before. */}}
{{- define "cleave.deviceTaints" -}}
{{- $v := .Values.health.deviceTaints -}}
{{- if kindIs "invalid" $v -}}
{{- if include "cleave.kube136" . -}}on{{- else -}}off{{- end -}}
{{- else -}}
{{- $v -}}
{{- end -}}
{{- end -}}
