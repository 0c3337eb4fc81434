{{/* The endpoint picker's configuration (llm-d-router's EndpointPickerConfig, llm-d.ai/v1alpha1):
which metrics it reads on each server's metrics port, and how it scores replicas. Every metric
name here is one the server exports (tests/deploy cross-checks them against /metrics). */}}
{{- define "loraplex.pickerConfig" -}}
{{- $p := .Values.router.picker }}
{{- $w := $p.weights }}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: single-profile-handler
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
    parameters:
      engineLabelKey: llm-d.ai/engine-type
      defaultEngine: vllm
      engineConfigs:
        - name: vllm
          queuedRequestsSpec: vllm:num_requests_waiting
          runningRequestsSpec: vllm:num_requests_running
          kvUsageSpec: vllm:kv_cache_usage_perc
          loraSpec: vllm:lora_requests_info
          cacheInfoSpec: vllm:cache_config_info
          # Adapter residency (read by lora-load-state-scorer; ignored by pickers without it).
          loraLoadedSpec: vllm:lora_adapter_loaded
          loraGPULoadedSpec: vllm:num_gpu_loaded_lora_adapters
          loraGPUSlotsSpec: vllm:max_gpu_lora_adapters
  - type: {{ $p.prefixScorer }}
    {{- if eq $p.prefixScorer "precise-prefix-cache-scorer" }}
    parameters:
      tokenProcessorConfig:
        blockSize: {{ default 16 .Values.config.block_size }}
      indexerConfig:
        tokenizersPoolConfig:
          modelName: {{ $p.tokenizer | quote }}
      kvEventsConfig:
        topicFilter: "kv@"
        discoverPods: true
        podDiscoveryConfig:
          socketPort: {{ .Values.router.kvEvents.port }}
    {{- end }}
  - type: {{ $p.loraScorer }}
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: max-score-picker
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: {{ $p.prefixScorer }}
        weight: {{ $w.prefix }}
      - pluginRef: {{ $p.loraScorer }}
        weight: {{ $w.lora }}
      - pluginRef: queue-scorer
        weight: {{ $w.queue }}
      - pluginRef: kv-cache-utilization-scorer
        weight: {{ $w.kvUsage }}
      - pluginRef: max-score-picker
{{- end }}
