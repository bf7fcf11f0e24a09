"""Engine backends: the server-owned interface, the registry, and one package per engine."""
