"""Operations as code: the Grafana dashboard (stam.ops.dashboard), the Helm chart checks (stam.ops.helm_check)
and the docker/ checks (stam.ops.docker_check)."""
