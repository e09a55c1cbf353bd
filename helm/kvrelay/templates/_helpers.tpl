{{/* Names and labels. */}}
{{- define "kvrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvrelay.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "kvrelay.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvrelay.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Where the app's files are mounted in every Ray container. */}}
{{- define "kvrelay.configDir" -}}/etc/kvrelay{{- end -}}

{{- define "kvrelay.secretName" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "kvrelay.fullname" .)) -}}
{{- end -}}

{{/* Ray's token: KubeRay reads the key `auth_token` (authOptions.secretName). */}}
{{- define "kvrelay.rayTokenSecretName" -}}
{{- .Values.auth.rayToken.existingSecret | default (printf "%s-ray-token" (include "kvrelay.fullname" .)) -}}
{{- end -}}

{{- define "kvrelay.hasApiKeys" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys .Values.apiKeys.adminKeys }}true{{ end -}}
{{- end -}}

{{/* Fail closed: API keys, or an explicit opt-out, never a silent default; and no `env` entry
     may replace what the chart sets for authentication (a later duplicate wins in a pod). */}}
{{- define "kvrelay.checkAuth" -}}
{{- $hasKeys := include "kvrelay.hasApiKeys" . -}}
{{- if and $hasKeys .Values.auth.allowUnauthenticated -}}
{{- fail "auth.allowUnauthenticated is true but API keys are configured (apiKeys.keys, apiKeys.adminKeys or apiKeys.existingSecret): set one or the other" -}}
{{- end -}}
{{- if not (or $hasKeys .Values.auth.allowUnauthenticated) -}}
{{- fail "no API keys: set apiKeys.existingSecret (a Secret with key api-keys) or apiKeys.keys, or set auth.allowUnauthenticated=true to serve the API without authentication" -}}
{{- end -}}
{{- range .Values.env -}}
{{- if has .name (list "KVRELAY_API_KEYS" "KVRELAY_ADMIN_API_KEYS" "KVRELAY_REQUIRE_API_KEYS") -}}
{{- fail (printf "env: %s is set by the chart from the API-key Secret (apiKeys); remove it from env" .name) -}}
{{- end -}}
{{- if has .name (list "RAY_AUTH_MODE" "RAY_AUTH_TOKEN" "RAY_AUTH_TOKEN_PATH") -}}
{{- fail (printf "env: %s would change Ray's token authentication, which the chart sets (auth.rayToken); remove it from env" .name) -}}
{{- end -}}
{{- end -}}
{{- if not (semverCompare ">=2.52.0" .Values.rayVersion) -}}
{{- fail (printf "rayVersion %s: Ray token authentication (RAY_AUTH_MODE=token) needs Ray 2.52.0 or newer" .Values.rayVersion) -}}
{{- end -}}
{{- end -}}

{{- define "kvrelay.hasConfigMap" -}}
{{- if or .Values.autoscaling.enabled .Values.pricing }}true{{ end -}}
{{- end -}}

{{/* The ServeConfig `model` value for the chosen source. */}}
{{- define "kvrelay.model" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "builtin" -}}
{{- required "model.name is required with model.source=builtin" $m.name -}}
{{- else if eq $m.source "pvc" -}}
{{- if not $m.pvc.claimName }}{{ fail "model.pvc.claimName is required with model.source=pvc" }}{{ end -}}
{{- printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) (trimPrefix "/" (required "model.path (inside the claim) is required with model.source=pvc" $m.path)) -}}
{{- else -}}
{{- if not (hasPrefix "/" $m.path) }}{{ fail (printf "model.path must be an absolute path in the image with model.source=image, got %q" $m.path) }}{{ end -}}
{{- $m.path -}}
{{- end -}}
{{- end -}}

{{/* serveConfigV2's application args: the ServeConfig fields. Each of the prefill and decode
     pools asks per replica for a sliver (0.01, cluster/roles.py REPLICA_SHARE) of its node role's
     resource, which only that group's nodes carry. */}}
{{- define "kvrelay.serveArgs" -}}
{{- $args := deepCopy .Values.serve -}}
{{- $_ := set $args "model" (include "kvrelay.model" .) -}}
{{- $_ := set $args "http" (dict "host" "0.0.0.0" "port" 8000) -}}
{{- $prefill := deepCopy (default (dict) $args.prefill) -}}
{{- $_ := set $prefill "resources" (dict "kvrelay_prefill" 0.01) -}}
{{- $_ := set $args "prefill" $prefill -}}
{{- $decode := deepCopy (default (dict) $args.decode) -}}
{{- $_ := set $decode "resources" (dict "kvrelay_decode" 0.01) -}}
{{- $_ := set $args "decode" $decode -}}
{{- if .Values.autoscaling.enabled -}}
{{- $_ := set $args "autoscaling_policy" (printf "%s/autoscaling-policy.yaml" (include "kvrelay.configDir" .)) -}}
{{- end -}}
{{- if .Values.pricing -}}
{{- $_ := set $args "pricing" (printf "%s/pricing.yaml" (include "kvrelay.configDir" .)) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* A replica count check the schema cannot express. */}}
{{- define "kvrelay.checkGroup" -}}
{{- $name := index . 0 -}}{{- $g := index . 1 -}}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) -}}
{{- fail (printf "%s.minReplicas (%v) is above %s.maxReplicas (%v)" $name $g.minReplicas $name $g.maxReplicas) -}}
{{- end -}}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "%s.replicas (%v) must be within %s.minReplicas..maxReplicas (%v..%v)" $name $g.replicas $name $g.minReplicas $g.maxReplicas) -}}
{{- end -}}
{{- end -}}

{{/* Volumes, mounts and env shared by every Ray container. */}}
{{- define "kvrelay.volumes" -}}
- name: kvrelay-cache
  emptyDir:
    sizeLimit: {{ .Values.model.cacheSizeLimit }}
{{- if include "kvrelay.hasConfigMap" . }}
- name: kvrelay-config
  configMap:
    name: {{ include "kvrelay.fullname" . }}-config
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: kvrelay-model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if .Values.loraAdapters.pvc.claimName }}
- name: kvrelay-lora-adapters
  persistentVolumeClaim:
    claimName: {{ .Values.loraAdapters.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "kvrelay.volumeMounts" -}}
- name: kvrelay-cache
  mountPath: /var/cache/kvrelay
{{- if include "kvrelay.hasConfigMap" . }}
- name: kvrelay-config
  mountPath: {{ include "kvrelay.configDir" . }}
  readOnly: true
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: kvrelay-model
  mountPath: {{ .Values.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.loraAdapters.pvc.claimName }}
- name: kvrelay-lora-adapters
  mountPath: {{ .Values.loraAdapters.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The Serve controller builds the app in a task that may run on any node, so every container
     gets the API keys (read by load_config) and the mounted files. Ray reads RAY_AUTH_MODE and
     RAY_AUTH_TOKEN (Ray 2.60: the env var first, then the file at RAY_AUTH_TOKEN_PATH); KubeRay,
     told the same Secret in authOptions, leaves variables already set alone. */}}
{{- define "kvrelay.env" -}}
- name: KVRELAY_CACHE_DIR
  value: /var/cache/kvrelay
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.rayTokenSecretName" . }}
      key: auth_token
{{- /* Serve's proxy streams to the ingress over gRPC, as the ingress to the workers (the app's
       ray.grpc_transport, README "Serving path"): the proxy reads it when it starts. */}}
- name: RAY_SERVE_PROXY_USE_GRPC
  value: "1"
{{- /* Serve's controller kills a proxy not ready within this (Ray's default: 5 s), as
       cluster/launcher.py's PROXY_READY_CHECK_TIMEOUT_S says. */}}
- name: RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
  value: "30"
{{- /* The largest response Serve's proxy reads from the ingress over gRPC (Ray's default: 4 MiB;
       cluster/launcher.py's PROXY_MAX_RESPONSE_BYTES). A replica's own bound comes with its app. */}}
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: "2147483647"
{{- if include "kvrelay.hasApiKeys" . }}
{{- /* Not optional: a missing Secret or `api-keys` key stops the pod (CreateContainerConfigError).
       A missing `admin-api-keys` only means no admin keys: less access, never more. */}}
- name: KVRELAY_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.secretName" . }}
      key: api-keys
- name: KVRELAY_ADMIN_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.secretName" . }}
      key: admin-api-keys
      optional: true
{{- /* A Secret whose api-keys value is empty must not mean an open API: the app refuses to start. */}}
- name: KVRELAY_REQUIRE_API_KEYS
  value: "true"
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Rolls a new RayCluster (KubeRay's zero-downtime upgrade) when mounted files change: Serve
     reads them only when it builds the app. Nothing here is derived from the API keys: a hash of
     them in the RayService (readable by more people than the Secret) would let a guess be checked
     offline. A new existingSecret name rolls the cluster by itself (the env changes); a change of
     the keys under the same name is announced by apiKeys.rotationId. */}}
{{- define "kvrelay.checksums" -}}
checksum/config: {{ printf "%s%s" (toYaml .Values.autoscaling) (toYaml .Values.pricing) | sha256sum | trunc 16 }}
{{- if include "kvrelay.hasApiKeys" . }}
kvrelay.io/api-keys-rotation: {{ .Values.apiKeys.rotationId | quote }}
{{- end }}
{{- end -}}

{{/* A pod template of one group. Args: dict root, role, group, container name. */}}
{{- define "kvrelay.podTemplate" -}}
{{- $root := .root -}}{{- $g := .group -}}
metadata:
  labels:
    {{- include "kvrelay.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
    {{- with $g.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "kvrelay.checksums" $root | nindent 4 }}
    {{- with $g.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if eq .role "head" }}
      ports:
        - {name: gcs-server, containerPort: 6379, protocol: TCP}
        - {name: dashboard, containerPort: 8265, protocol: TCP}
        - {name: client, containerPort: 10001, protocol: TCP}
        - {name: serve, containerPort: 8000, protocol: TCP}
        - {name: metrics, containerPort: 8080, protocol: TCP}
      {{- else }}
      ports:
        - {name: serve, containerPort: 8000, protocol: TCP}
        - {name: metrics, containerPort: 8080, protocol: TCP}
      {{- end }}
      env:
        {{- include "kvrelay.env" $root | nindent 8 }}
      resources:
        {{- toYaml $g.resources | nindent 8 }}
      volumeMounts:
        {{- include "kvrelay.volumeMounts" $root | nindent 8 }}
  volumes:
    {{- include "kvrelay.volumes" $root | nindent 4 }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
