{{/* Names and labels. */}}
{{- define "stam.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stam.fullname" -}}
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

{{- define "stam.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stam.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "stam.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "stam.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stam
{{- end -}}

{{- define "stam.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "stam.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stam.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "stam.secretName" -}}
{{- default (printf "%s-secrets" (include "stam.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "stam.rayServiceName" -}}
{{- printf "%s-llm" (include "stam.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* Base URL of the model: the RayService's serve Service (KubeRay names it <rayservice>-serve-svc), else llm.url. */}}
{{- define "stam.llmUrl" -}}
{{- if .Values.rayService.enabled -}}
{{- printf "http://%s-serve-svc.%s.svc:8000/v1" (include "stam.rayServiceName" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.llm.url -}}
{{- end -}}
{{- end -}}

{{- define "stam.llmModel" -}}
{{- if .Values.rayService.enabled -}}{{ .Values.rayService.model.id }}{{- else -}}{{ .Values.llm.model }}{{- end -}}
{{- end -}}

{{/* Input topic of each write stage (what its consumer lag is measured on). */}}
{{- define "stam.stageTopic" -}}
{{- $topics := dict "extract" "entries.v1" "link" "extracted.v1" "impact" "linked.v1" "update" "impacted.v1" "fused" "entries.v1" -}}
{{- printf "%s.%s" .prefix (get $topics .stage) -}}
{{- end -}}

{{/*
The write deployments as a list of dicts {name, stages, appId, replicas, resources, autoscaling, component}.
mode fused (the default): one, running the one-hop write path (`stam worker --stages fused`); mode all: one, running
the four stages (`stam worker --stages all`); mode groups: one per group, each with its own consumer group id.
*/}}
{{- define "stam.writeDeployments" -}}
{{- $w := .Values.write -}}
{{- $out := list -}}
{{- if eq $w.mode "all" -}}
{{- $out = append $out (dict "name" "write" "stages" (list "extract" "link" "impact" "update") "all" true "appId" $w.appId "replicas" $w.replicas "resources" $w.resources "autoscaling" $w.autoscaling) -}}
{{- else if eq $w.mode "fused" -}}
{{- $out = append $out (dict "name" "write" "stages" (list "fused") "all" false "appId" $w.appId "replicas" $w.replicas "resources" $w.resources "autoscaling" $w.autoscaling) -}}
{{- else -}}
{{- $seen := dict -}}
{{- range $g := $w.groups -}}
{{- range $s := $g.stages -}}
{{- if hasKey $seen $s -}}{{- fail (printf "write.groups: stage %s is in more than one group" $s) -}}{{- end -}}
{{- $_ := set $seen $s $g.name -}}
{{- end -}}
{{- $auto := merge (deepCopy (default dict $g.autoscaling)) $w.autoscaling -}}
{{- $out = append $out (dict "name" (printf "write-%s" $g.name) "stages" $g.stages "all" false "appId" (printf "%s-%s" $w.appId $g.name) "replicas" (default $w.replicas $g.replicas) "resources" (default $w.resources $g.resources) "autoscaling" $auto) -}}
{{- end -}}
{{- range $s := list "extract" "link" "impact" "update" -}}
{{- if not (hasKey $seen $s) -}}{{- fail (printf "write.groups: stage %s is in no group (every stage must run somewhere)" $s) -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "items" $out) -}}
{{- end -}}

{{/* Pod security context: non-root, RuntimeDefault seccomp. */}}
{{- define "stam.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "stam.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Environment shared by every STAM container: the ConfigMap plus the secrets as env (optional keys). */}}
{{- define "stam.env" -}}
{{- $secret := include "stam.secretName" . -}}
{{- range $env, $key := dict "STAM_KAFKA_SASL_PASSWORD" "kafka-sasl-password" "STAM_REDIS_PASSWORD" "redis-password" "STAM_MILVUS_TOKEN" "milvus-token" "STAM_QUERY_TOKEN" "query-token" "STAM_LLM_API_KEY" "llm-api-key" "STAM_READER_API_KEY" "reader-api-key" }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end -}}

{{- define "stam.volumeMounts" -}}
- name: home
  mountPath: /var/lib/stam
- name: tmp
  mountPath: /tmp
- name: secrets
  mountPath: /etc/stam/secrets
  readOnly: true
{{- if .Values.kafka.caSecret }}
- name: kafka-ca
  mountPath: /etc/stam/kafka-ca
  readOnly: true
{{- end }}
{{- if .Values.redis.caSecret }}
- name: redis-ca
  mountPath: /etc/stam/redis-ca
  readOnly: true
{{- end }}
{{- if .Values.deletion.gateConfigMap }}
- name: deletion-gate
  mountPath: /etc/stam/deletion-gate
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stam.volumes" -}}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.home.sizeLimit }}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 256Mi
- name: secrets
  secret:
    secretName: {{ include "stam.secretName" . }}
    defaultMode: 0440
    items:
      - key: data.key
        path: data.key
      {{- if .Values.secrets.sourcesFile }}
      - key: sources.json
        path: sources.json
      {{- end }}
      {{- if .Values.secrets.queryTokensFile }}
      - key: query-tokens.json
        path: query-tokens.json
      {{- end }}
{{- if .Values.kafka.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.caSecret }}
    defaultMode: 0444
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if .Values.redis.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.caSecret }}
    defaultMode: 0444
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if .Values.deletion.gateConfigMap }}
- name: deletion-gate
  configMap:
    name: {{ .Values.deletion.gateConfigMap }}
    defaultMode: 0444
    items:
      - key: gate.json
        path: gate.json
      - key: head.npz
        path: head.npz
{{- end }}
{{- end -}}

{{/* Fails the render when KEDA could scale a consumer group past the partitions (idle consumers). */}}
{{- define "stam.checkAutoscaling" -}}
{{- $a := .autoscaling -}}
{{- if $a.enabled -}}
{{- if gt (int $a.maxReplicaCount) (int .partitions) -}}
{{- fail (printf "%s: autoscaling.maxReplicaCount %d exceeds kafka.partitions %d (consumers beyond the partition count get no work)" .name (int $a.maxReplicaCount) (int .partitions)) -}}
{{- end -}}
{{- if gt (int $a.minReplicaCount) (int $a.maxReplicaCount) -}}
{{- fail (printf "%s: autoscaling.minReplicaCount > maxReplicaCount" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "stam.egressTo" -}}
{{- /* one egress rule: .cidrs (empty: any address) on .ports */ -}}
- ports:
  {{- range .ports }}
    - port: {{ . }}
      protocol: TCP
  {{- end }}
  {{- with .cidrs }}
  to:
    {{- range . }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  {{- end }}
{{- end -}}
