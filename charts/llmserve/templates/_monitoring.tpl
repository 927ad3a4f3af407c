{{/* Target labels the dashboards and alerts group by, from the labels the operator
puts on engine, prefill (spec.prefill) and gateway pods (llmserve/operator/builders.py,
labels()). */}}
{{- define "llmserve.monitoring.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_serving_llmserve_io_deployment]
  targetLabel: llmdeployment
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
{{- end -}}

{{- define "llmserve.monitoring.selector" -}}
matchExpressions:
  - {key: app.kubernetes.io/part-of, operator: In, values: [llmserve]}
  - {key: app.kubernetes.io/managed-by, operator: In, values: [llmserve-operator]}
  - {key: app.kubernetes.io/component, operator: In, values: [engine, prefill, gateway]}
{{- end -}}
