"""Operations: deployment checks and the Grafana dashboard as code."""
