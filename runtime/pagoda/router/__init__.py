"""`pagoda router`: one OpenAI endpoint in front of several `pagoda serve` replicas.

backends (the replicas and their load) <- discovery (flags or a Kubernetes Service's EndpointSlices)
                                       <- health (probes /health and scrapes /metrics)
policies (which backend) -> proxy (forwards, streams, retries) -> app (FastAPI routes, metrics)
"""
