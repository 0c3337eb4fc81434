{{/* Names and labels, as `helm create` makes them. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.fullname" -}}
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

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" . }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Labels of a side component (postgresql, redis, migrate, test): name and instance, its own component. */}}
{{- define "loraplex.componentLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplex.image" -}}
{{- $suffix := ternary "cuda" "cpu" .Values.gpu.enabled }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $suffix) .Values.image.tag) }}
{{- end }}

{{- define "loraplex.secretName" -}}
{{- default (include "loraplex.fullname" .) .Values.existingSecret }}
{{- end }}

{{/* A StatefulSet when the disk KV tier is on per-replica persistent volumes; a Deployment otherwise. */}}
{{- define "loraplex.statefulset" -}}
{{- if and .Values.kvCache.disk.enabled (eq .Values.kvCache.disk.volume "persistent") }}true{{ end }}
{{- end }}

{{/* Whether more than one replica may run at once. */}}
{{- define "loraplex.multiReplica" -}}
{{- if or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled .Values.keda.enabled }}true{{ end }}
{{- end }}

{{/* The server's shutdown grace in seconds: the setting's value, else the server's default (10;
tests/deploy checks it against the settings model). shutdown_grace_s wins over the older
graceful_shutdown_s when a settings model has both. */}}
{{- define "loraplex.shutdownGrace" -}}
{{- $c := .Values.config }}
{{- $grace := 10 }}
{{- if hasKey $c "graceful_shutdown_s" }}{{ if not (kindIs "invalid" $c.graceful_shutdown_s) }}{{ $grace = $c.graceful_shutdown_s }}{{ end }}{{ end }}
{{- if hasKey $c "shutdown_grace_s" }}{{ if not (kindIs "invalid" $c.shutdown_grace_s) }}{{ $grace = $c.shutdown_grace_s }}{{ end }}{{ end }}
{{- int $grace }}
{{- end }}

{{- define "loraplex.terminationGrace" -}}
{{- $floor := add (include "loraplex.shutdownGrace" . | int) (int .Values.preStopSleepSeconds) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $floor (int .Values.kvFlushSeconds) }}
{{- else if le (int .Values.terminationGracePeriodSeconds) $floor }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed the server's shutdown grace plus preStopSleepSeconds (%d), or open requests and the KV tiers' flush are cut off by SIGKILL" (int .Values.terminationGracePeriodSeconds) $floor) }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* One setting as an environment value: whole numbers without an exponent, lists space-separated. */}}
{{- define "loraplex.envValue" -}}
{{- $v := . }}
{{- if kindIs "float64" $v }}
{{- if eq $v (floor $v) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end }}
{{- else if kindIs "slice" $v }}
{{- join " " $v }}
{{- else }}
{{- $v }}
{{- end }}
{{- end }}

{{/* KV events are published when the router is on with them. */}}
{{- define "loraplex.kvEvents" -}}
{{- if and .Values.router.enabled .Values.router.kvEvents.enabled }}true{{ end }}
{{- end }}

{{/* The model name routers see: config.served_model_name, else "model". */}}
{{- define "loraplex.modelName" -}}
{{- default "model" .Values.config.served_model_name }}
{{- end }}

{{/* vLLM's --kv-events-config as JSON; $(POD_IP) is expanded by the kubelet. */}}
{{- define "loraplex.kvEventsConfig" -}}
{{- $topic := printf "kv@$(POD_IP):%d@%s" (int .Values.containerPort) (include "loraplex.modelName" .) }}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.router.kvEvents.port)) "replay_endpoint" (printf "tcp://*:%d" (int .Values.router.kvEvents.replayPort)) "topic" $topic "encoding" (default "array" .Values.router.kvEvents.encoding) | toJson }}
{{- end }}

{{/* Labels inference routers read on the model server pods. */}}
{{- define "loraplex.routerPodLabels" -}}
llm-d.ai/engine-type: vllm
llm-d.ai/role: decode
{{- end }}

{{- define "loraplex.picker.fullname" -}}{{ include "loraplex.fullname" . | trunc 50 }}-epp{{- end }}

{{/* Paths inside the pod. */}}
{{- define "loraplex.paths.data" }}/var/lib/loraplex{{ end }}
{{- define "loraplex.paths.cache" }}/var/cache/loraplex{{ end }}
{{- define "loraplex.paths.adapters" }}/var/lib/loraplex-adapters{{ end }}
{{- define "loraplex.paths.kv" }}/var/lib/loraplex-kv{{ end }}

{{- define "loraplex.postgresql.fullname" -}}{{ include "loraplex.fullname" . | trunc 52 }}-postgresql{{- end }}
{{- define "loraplex.redis.fullname" -}}{{ include "loraplex.fullname" . | trunc 57 }}-redis{{- end }}

{{/* Refuse value combinations that deploy but break (the bugs peers' charts ship). */}}
{{- define "loraplex.validate" -}}
{{- $multi := include "loraplex.multiReplica" . }}
{{- if and .Values.autoscaling.enabled .Values.keda.enabled }}
{{- fail "autoscaling.enabled and keda.enabled both make an HPA for the workload: choose one" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not (or .Values.autoscaling.targetCPUUtilizationPercentage .Values.autoscaling.requestsWaiting.enabled)) }}
{{- fail "autoscaling.enabled needs a metric: targetCPUUtilizationPercentage or requestsWaiting.enabled" }}
{{- end }}
{{- if and .Values.postgresql.enabled .Values.database.url }}
{{- fail "database.url and postgresql.enabled: choose the external database or the in-chart one" }}
{{- end }}
{{- if and .Values.redisTrial.enabled .Values.redis.url }}
{{- fail "redis.url and redisTrial.enabled: choose the external Redis or the in-chart one" }}
{{- end }}
{{- if $multi }}
{{- if not (or .Values.database.url .Values.postgresql.enabled .Values.existingSecret) }}
{{- fail "more than one replica needs a shared database: set database.url (PostgreSQL), existingSecret, or postgresql.enabled; each replica would otherwise keep its own SQLite file" }}
{{- end }}
{{- if hasPrefix "sqlite" .Values.database.url }}
{{- fail "more than one replica needs PostgreSQL: SQLite is one process's file" }}
{{- end }}
{{- if not (or .Values.redis.url .Values.redisTrial.enabled .Values.existingSecret) }}
{{- fail "more than one replica needs a shared Redis for quotas (redis.url, existingSecret, or redisTrial.enabled)" }}
{{- end }}
{{- if and (not .Values.adapterStore.existingClaim) (not .Values.adapterStore.persistence.enabled) }}
{{- fail "more than one replica needs a shared adapter store: adapterStore.persistence.enabled or adapterStore.existingClaim" }}
{{- end }}
{{- if and (not .Values.adapterStore.existingClaim) (not (has "ReadWriteMany" .Values.adapterStore.persistence.accessModes)) }}
{{- fail "more than one replica needs the adapter store ReadWriteMany (adapterStore.persistence.accessModes): a ReadWriteOnce volume mounts on one node only, so a second replica or a rolling update would hang" }}
{{- end }}
{{- end }}
{{- if .Values.kvCache.disk.enabled }}
{{- if kindIs "invalid" .Values.config.disk_kv_cache_bytes }}
{{- fail "kvCache.disk.enabled needs config.disk_kv_cache_bytes (the tier's cap, below kvCache.disk.size)" }}
{{- end }}
{{- end }}
{{- if and .Values.router.enabled (kindIs "invalid" .Values.metricsPort) }}
{{- fail "router.enabled needs metricsPort: the endpoint picker scrapes the metrics port (the serving port's /metrics is the operator's)" }}
{{- end }}
{{- if and .Values.router.enabled (eq .Values.router.picker.prefixScorer "precise-prefix-cache-scorer") }}
{{- if not .Values.router.kvEvents.enabled }}
{{- fail "router.picker.prefixScorer=precise-prefix-cache-scorer reads KV events: set router.kvEvents.enabled" }}
{{- end }}
{{- if not .Values.router.picker.tokenizer }}
{{- fail "router.picker.prefixScorer=precise-prefix-cache-scorer tokenizes prompts: set router.picker.tokenizer to the served model's tokenizer" }}
{{- end }}
{{- end }}
{{- if and .Values.config.auth (eq (toString .Values.config.auth) "open") }}
{{- fail "config.auth=open serves every caller as one tenant and is refused off loopback: use keys" }}
{{- end }}
{{- end }}
