"""Request timing statistics and the Prometheus exporter used by the OpenAI server."""
