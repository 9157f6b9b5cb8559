"""Monitoring: the platform's Prometheus metrics (`metrics`), the sweep board that
`rayhpc status` reads from a running cluster (`board`), and the status view (`status`).

Ray's dashboard and metrics endpoint come with every cluster the platform starts; the
scrape config and Grafana dashboard for these metrics are in `cluster_configs/monitoring/`.
"""
