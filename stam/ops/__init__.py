"""Operations as code: the Grafana dashboard (stam.ops.dashboard) and the Helm chart checks (stam.ops.helm_check)."""
