"""The HTTP client: Client and AsyncClient over one sans-I/O core, the replicas, the transports."""
